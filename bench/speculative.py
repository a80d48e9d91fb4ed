"""Speculative decoding benchmark: batch-1 latency and tokens/s with and without speculation.

Two workloads on the embedded model (SmolLM2-135M-Instruct, its chat template), greedy:
  copy  an input-grounded task: copy / extract from a long passage (the answer repeats it);
  free  free generation (a story), where prompt lookup rarely finds the continuation.
Every configuration runs on every workload in turn, repetition after repetition, so a noisy
shared machine slows all of them alike; the table reports medians and ratios to "none".
Greedy outputs are checked to be identical to the run without speculation.

    .venv/bin/python bench/speculative.py --reps 3 --max-tokens 128 --configs none,ngram,draft
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

PASSAGE = (
    "The Apollo program, also known as Project Apollo, was the third United States human "
    "spaceflight program carried out by the National Aeronautics and Space Administration "
    "(NASA), which succeeded in preparing and landing the first humans on the Moon from 1968 "
    "to 1972. It was first conceived in 1960 during President Dwight D. Eisenhower's "
    "administration as a three-person spacecraft to follow the one-person Project Mercury, "
    "which put the first Americans in space. Apollo was later dedicated to President John F. "
    "Kennedy's national goal for the 1960s of landing a man on the Moon and returning him "
    "safely to the Earth in an address to Congress on May 25, 1961. It was the third US human "
    "spaceflight program to fly, preceded by the two-person Project Gemini conceived in 1961 "
    "to extend spaceflight capability in support of Apollo. Kennedy's goal was accomplished on "
    "the Apollo 11 mission when astronauts Neil Armstrong and Buzz Aldrin landed their Apollo "
    "Lunar Module on July 20, 1969, and walked on the lunar surface, while Michael Collins "
    "remained in lunar orbit in the command and service module."
)

WORKLOADS = {
    "copy": [{"role": "user", "content": f"Copy the following text exactly, word for word:\n\n"
                                          f"{PASSAGE}"}],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                                          "finds a strange machine washed up on the beach."}],
}

CONFIGS: dict[str, Any] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "draft": {"method": "draft", "num_speculative_tokens": 3},  # self-draft, 1/4 of the layers
    "draft-int4": {"method": "draft", "quantization": "int4", "num_speculative_tokens": 3},
}


def run_once(llm: Any, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    from argosy_runtime import SamplingParams

    stats = llm.engine.get_stats()
    drafted0, accepted0 = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat(messages, params)[0]
    elapsed = time.perf_counter() - start
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    decode_s = (m.last_token_time or 0) - (m.first_token_time or 0)
    stats = llm.engine.get_stats()
    return {
        "tokens": out.outputs[0].token_ids,
        "latency_s": elapsed,
        "tok_per_s": n / elapsed,
        "decode_tok_per_s": (n - 1) / decode_s if decode_s > 0 else float("nan"),
        "drafted": stats.spec_decode_num_draft_tokens - drafted0,
        "accepted": stats.spec_decode_num_accepted_tokens - accepted0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="none,ngram",
                        help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared, oversubscribed CPU two "
                             "threads measured ~10x slower per token than one)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)

    import torch
    from argosy_runtime import LLM

    torch.set_num_threads(args.threads)

    names = args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}")
    llms = {name: LLM(model=args.model, dtype=args.dtype, kv_cache_memory=256 << 20,
                      speculative=CONFIGS[name]) for name in names}
    for llm in llms.values():  # warm-up (first-call allocations, lazy init)
        run_once(llm, WORKLOADS["free"], 8)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for workload, messages in WORKLOADS.items():
            for name, llm in llms.items():
                r = run_once(llm, messages, args.max_tokens)
                results.setdefault((workload, name), []).append(r)
                print(f"rep {rep} {workload:5s} {name:6s} {r['tok_per_s']:6.1f} tok/s "
                      f"accepted {r['accepted']}/{r['drafted']}", file=sys.stderr, flush=True)

    print("| workload | speculation | latency (s) | tokens/s | decode tokens/s | vs none "
          "| acceptance | identical output |")
    print("|---|---|---|---|---|---|---|---|")
    raw: dict[str, Any] = {}
    for workload in WORKLOADS:
        base = statistics.median(r["tok_per_s"] for r in results[(workload, names[0])])
        ref_tokens = results[(workload, names[0])][0]["tokens"]
        for name in names:
            rs = results[(workload, name)]
            tps = statistics.median(r["tok_per_s"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            # Where the output first leaves the reference (bf16: after a near-tie, see
            # docs/speculative.md "Exactness in bfloat16"), over all repetitions.
            diverged = [next((i for i, (a, b) in enumerate(zip(r["tokens"], ref_tokens)) if a != b),
                             min(len(r["tokens"]), len(ref_tokens)))
                        for r in rs if r["tokens"] != ref_tokens]
            same = "yes" if not diverged else f"NO (from token {min(diverged)})"
            acc = f"{accepted / drafted:.0%} ({accepted}/{drafted})" if drafted else "-"
            print(f"| {workload} | {name} | {statistics.median(r['latency_s'] for r in rs):.2f} "
                  f"| {tps:.1f} | {statistics.median(r['decode_tok_per_s'] for r in rs):.1f} "
                  f"| {tps / base:.2f}x | {acc} | {same} |")
            raw[f"{workload}/{name}"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
