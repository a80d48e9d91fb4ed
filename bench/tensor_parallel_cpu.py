"""Tensor parallelism on the CPU: decode tokens/s of one bfloat16 model as one process using
every CPU thread vs split over 2 ranks (worker processes) with half the threads each.

    .venv/bin/python bench/tensor_parallel_cpu.py [--layers 8] [--rounds 3]

A random Llama of Llama-3.2-1B's layer shape (hidden 2048, 32 heads, 8 KV heads, MLP 8192;
fewer layers to keep it short) with the embedded tokenizer's vocabulary. Per configuration and
round: a batch of B requests decoding `--tokens` greedy tokens each, stepped by hand; tokens/s
= B / the median decode step (the machine is shared: medians resist other jobs' bursts).
Configurations: tp=1 (the C++ decode layers, the one-process default), tp=1 without them (the
module path every tensor-parallel rank runs, so the split's own cost shows), tp=2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

sys.path.insert(0, "tests/runtime")


# (name, tensor_parallel_size, C++ decode layers on)
CONFIGS = (("tp=1", 1, True), ("tp=1 module path", 1, False), ("tp=2", 2, False))


def decode_tokens_per_s(engine, batch: int, tokens: int, tag: str) -> float:  # noqa: ANN001
    from argosy_runtime import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [1, 504, 2365, 282, 260 + i, 5887, 3733, 4147], params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times[1:])  # [0]: the prefill step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    import torch
    from argosy_runtime import LLMEngine
    from model_factory import make_random_model_dir

    folder = make_random_model_dir(
        tempfile.mkdtemp(prefix="tp-bench-"), "llama", num_hidden_layers=args.layers,
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        init_std=0.02, dtype=torch.bfloat16)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):  # configurations alternate within each round
        for name, size, cpp_layers in CONFIGS:
            engine = LLMEngine(model=str(folder), dtype="bfloat16", tensor_parallel_size=size,
                               enable_prefix_caching=False, kv_cache_memory=512 << 20)
            if not cpp_layers:
                engine.model.cpu_decode = None
            decode_tokens_per_s(engine, 1, 4, f"warm-{name}")
            for batch in batches:
                tps = decode_tokens_per_s(engine, batch, args.tokens, f"{name}-{rnd}-{batch}")
                results.setdefault((name, batch), []).append(tps)
                print(f"round {rnd} {name:17s} batch {batch:3d}: {tps:7.1f} tok/s", flush=True)
            engine.shutdown()
            del engine
    print("\n| configuration | " + " | ".join(f"batch {b} tok/s (median of rounds)" for b in batches)
          + " |")
    print("|---|" + "---|" * len(batches))
    for name, _, _ in CONFIGS:
        cells = [f"{statistics.median(results[(name, b)]):.1f}" for b in batches]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
