"""Speculative decoding against batch size: where extra verification rows stop being free.

Runs the same batch of free-generation prompts (greedy, `ignore_eos`) through one LLM per
configuration and prints output tokens/s and the ratio to no speculation, per batch size.

    python bench/speculative_batch.py --batch-sizes 1,2,4,8,16 --reps 2
"""

from __future__ import annotations

import argparse
import sys
import time

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a city at night", "an old map",
          "a quiet library", "a river journey", "a baker at dawn", "a mountain storm", "a chess game",
          "a desert caravan", "a forgotten song", "a space station", "a garden party",
          "a train station", "a detective"]
CONFIGS = {
    "none": None,
    "int4": {"method": "draft", "quantization": "int4", "num_speculative_tokens": 3},
    "int4-capped": {"method": "draft", "quantization": "int4", "num_speculative_tokens": 3,
                    "disable_by_batch_size": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default="none,int4,int4-capped",
                        help=f"comma-separated, from {', '.join(CONFIGS)} (the first is the baseline)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(sizes) > len(TOPICS):
        parser.error(f"batch sizes up to {len(TOPICS)}")

    import torch
    from argosy_runtime import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llms = {name: LLM(model=args.model, dtype=args.dtype, kv_cache_memory=256 << 20,
                      speculative=CONFIGS[name]) for name in names}
    for llm in llms.values():  # warm-up (first-call allocations, the C++ build)
        llm.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    print("| rep | batch | " + " | ".join(f"{n} tok/s" for n in names) + " |")
    print("|---" * (2 + len(names)) + "|")
    for rep in range(args.reps):
        for n in sizes:
            prompts = [f"Write a short story about {t}." for t in TOPICS[:n]]
            rate = {}
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompts, params)
                rate[name] = n * args.max_tokens / (time.perf_counter() - start)
            base = rate[names[0]]
            cells = [f"{rate[name]:.0f} ({rate[name] / base:.2f}x)" for name in names]
            print(f"| {rep} | {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
