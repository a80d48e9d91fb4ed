"""Write a copy of a llama GGUF file that keeps only its first N decoder layers.

The GPU check's engine section runs the embedded SmolLM2-135M, but its GGUF (94 MB) is larger
than what may travel to a lent GPU machine in one call (64 MiB with the working tree). The first
layers of the same file, same tokenizer, same quantized tensors byte for byte, still exercise
every kernel path the full model does; only the outputs' quality differs, and the check compares
two attention paths of one model with each other, not with a reference answer.

    python bench/truncate_gguf.py smollm2-135m .gpu/smollm2-8l.gguf --layers 8
"""

from __future__ import annotations

import argparse
import sys

import gguf
from argosy_runtime.model_loader.resolve import resolve_model_path


def truncate(src: str, dst: str, layers: int) -> int:
    """Copy src to dst with layers >= `layers` left out; returns the tensors written."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    block_count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = int(reader.fields[block_count_key].contents())
    if not 0 < layers <= total:
        raise SystemExit(f"--layers must be in 1..{total} (the file has {total} layers)")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # The writer adds the file header fields and the architecture itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = layers if field.name == block_count_key else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(kept)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a .gguf path or an embedded model name (smollm2-135m)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--layers", type=int, default=8, help="decoder layers to keep (default: 8)")
    args = p.parse_args()
    src, fmt = resolve_model_path(args.model)
    if fmt != "gguf":
        raise SystemExit(f"{args.model!r} is not a .gguf file")
    n = truncate(str(src), args.out, args.layers)
    print(f"wrote {args.out}: {n} tensors, the first {args.layers} layers of {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
