"""Quantization benchmarks (results recorded in docs/benchmarks/quantization.md).

    python -m argosy_runtime.quantization.bench modes     # per mode: bytes, ppl, decode tok/s
    python -m argosy_runtime.quantization.bench kernels   # packed vs dequantize-then-GEMM by M
    python -m argosy_runtime.quantization.bench requant   # int4 re-quantization study (ppl)

All modes run side by side in one process so that ratios are comparable on a shared machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

_RUN_IDS = itertools.count()  # request ids stay unique across timings of one engine


def _decode_tok_s(engine, batch: int, steps: int) -> float:
    """Tokens/s of `steps` decode steps with `batch` running requests."""
    from argosy_runtime import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    run = next(_RUN_IDS)
    ids = [f"b{batch}-{run}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, f"Request {i}: the history of the number {i * 7} is", params)
    produced = {rid: 0 for rid in ids}
    while min(produced.values()) < 1:  # prefill (and first token) for every request
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return batch * steps / elapsed


MODES = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8-kv": {"kv_cache_dtype": "int8"},
}


def bench_modes(args: argparse.Namespace) -> list[dict]:
    """Load every mode, then time them in turns: each repeat runs every mode once per batch
    size, and each keeps its best. Timing one mode after another would hand whichever ran
    during a quiet minute of this shared machine a head start (seen: bf16 first at 37 tok/s,
    the same bf16 weights with the int8 KV cache a minute later at 46)."""
    from argosy_runtime import LLM
    from argosy_runtime.cli.perplexity import perplexity
    from argosy_runtime.model_runner import kv_cache_bytes_per_block
    from argosy_runtime.quantization import weight_bytes

    text = open(args.text, encoding="utf-8").read() if args.text else None
    rows, engines = [], []
    for mode in args.modes:
        started = time.perf_counter()
        try:
            # budget 64: a decode of 32 sequences fits in a step
            llm = LLM(model=args.model, dtype="bfloat16", kv_cache_memory=args.kv_memory,
                      enable_prefix_caching=False, max_num_batched_tokens=64, **MODES[mode])
            llm.generate("warm up", None)
        except Exception as exc:  # a mode the engine cannot run yet: say so, go on
            print(json.dumps({"mode": mode, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        engine = llm.engine
        cc = engine.cache_config
        row = {
            "mode": mode,
            "load_s": round(time.perf_counter() - started, 1),
            "weight_bytes": weight_bytes(engine.model),
            "kv_bytes_per_token": kv_cache_bytes_per_block(engine.model, cc.block_size,
                                                           cc.cache_dtype) / cc.block_size,
            "kv_tokens_in_pool": cc.num_blocks * cc.block_size,
        }
        if text:
            ids = llm.get_tokenizer().encode(text)[: args.ppl_tokens]
            row["perplexity"] = round(perplexity(llm, ids, 512, 256)["perplexity"], 4)
        rows.append(row)
        engines.append(engine)
    for batch in args.batches:
        key = f"decode_tok_s_b{batch}"
        for _ in range(args.repeats):
            for row, engine in zip(rows, engines, strict=True):
                row[key] = max(row.get(key, 0.0), round(_decode_tok_s(engine, batch, args.steps), 1))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def bench_kernels(args: argparse.Namespace) -> None:
    """Per-call time of each path for SmolLM2's projection shapes, bf16 activations."""
    from argosy_runtime.quantization import Int4Linear, Int8Linear

    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
    for name, (k, n) in shapes.items():
        lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        layers = {"int8": Int8Linear.from_linear(lin), "int4": Int4Linear.from_linear(lin, 128)}
        for m in args.tokens:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "bf16_us": _time(lambda: lin(x))}  # noqa: B023
            for label, layer in layers.items():
                saved = layer.packed_max_tokens
                layer.packed_max_tokens = 1 << 30
                row[f"{label}_packed_us"] = _time(lambda: layer(x))  # noqa: B023
                layer.packed_max_tokens = 0
                row[f"{label}_dequant_us"] = _time(lambda: layer(x))  # noqa: B023
                layer.packed_max_tokens = saved
            print(json.dumps(row), flush=True)


def _time(fn, repeats: int = 15) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn()
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return round(best * 1e6, 1)


def bench_requant(args: argparse.Namespace) -> None:
    """Perplexity (dense causal forward, no engine) of int4 variants on the embedded model:
    the GGUF's own Q4_1 blocks kept, and re-quantized to group 128 by RTN and by GPTQ."""
    from argosy_runtime.model_loader import load_checkpoint
    from argosy_runtime.models import LlamaForCausalLM
    from argosy_runtime.quantization import QuantizationConfig, load_quantized_weights
    from argosy_runtime.quantization.calibration import _layer_forward

    ckpt = load_checkpoint(args.model)
    ids = ckpt.tokenizer.encode(open(args.text, encoding="utf-8").read())[: args.ppl_tokens]
    seqs = torch.tensor(ids[: len(ids) // 512 * 512]).view(-1, 512)

    @torch.no_grad()
    def ppl(model) -> float:
        b, t = seqs.shape
        positions = torch.arange(t).repeat(b)
        h = model.model.embed_tokens(seqs)
        for layer in model.model.layers:
            h = _layer_forward(model, layer, h, positions)
        logits = model.compute_logits(model.model.norm(h).view(b * t, -1)).view(b, t, -1)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                seqs[:, 1:].reshape(-1))
        return math.exp(nll.item())

    variants = {
        "float (dequantized Q4_1)": None,
        "int8": QuantizationConfig("int8"),
        "int4 kept Q4_1 blocks (g32)": QuantizationConfig("int4", 128),
        "int4 g128 RTN+clip re-quantized": QuantizationConfig("int4", 128, keep_gguf_blocks=False),
        "int4 g64 RTN+clip re-quantized": QuantizationConfig("int4", 64, keep_gguf_blocks=False),
        "int4 g128 GPTQ re-quantized": QuantizationConfig("int4", 128, keep_gguf_blocks=False,
                                                          algorithm="gptq"),
    }
    base = None
    for label, config in variants.items():
        model = LlamaForCausalLM(ckpt.spec, torch.float32)
        started = time.perf_counter()
        if config is None:
            model.load_weights(ckpt.iter_weights())
        else:
            load_quantized_weights(model, ckpt, config)
        load_s = time.perf_counter() - started
        value = ppl(model)
        base = base or value
        print(json.dumps({"variant": label, "perplexity": round(value, 4),
                          "increase": f"{value / base - 1:+.2%}", "load_s": round(load_s, 1),
                          "tokens": int(seqs.numel())}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    modes = sub.add_parser("modes")
    modes.add_argument("--model", default="smollm2-135m")
    modes.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    modes.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    modes.add_argument("--steps", type=int, default=16)
    modes.add_argument("--repeats", type=int, default=2)
    modes.add_argument("--kv-memory", type=int, default=256 << 20)
    modes.add_argument("--text", default=None, help="text file for perplexity (optional)")
    modes.add_argument("--ppl-tokens", type=int, default=1024)
    kernels = sub.add_parser("kernels")
    kernels.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64, 128, 256])
    requant = sub.add_parser("requant")
    requant.add_argument("--model", default="smollm2-135m")
    requant.add_argument("--text", required=True)
    requant.add_argument("--ppl-tokens", type=int, default=1024)
    for p in (modes, kernels, requant):
        p.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads (default 1: on a shared, oversubscribed "
                            "CPU, spinning OpenMP barriers make 2 threads ~10x slower than 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"modes": bench_modes, "kernels": bench_kernels, "requant": bench_requant}[args.kind](args)


if __name__ == "__main__":
    main()
