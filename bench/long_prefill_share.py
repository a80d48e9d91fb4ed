"""What `long_prefill_token_threshold` buys: short prompts that arrive with long ones.

The offline engine (the embedded SmolLM2-135M, real weights) gets two long prompts (~1560
tokens each) and four short chat-sized prompts at the same moment, 8 greedy tokens each, with a
step budget of --budget tokens; then the same with each threshold of --thresholds ("none":
off). Reported per setting, the median over --rounds rounds: time to first token of the long
prompts, of the short ones, and the wall time of the whole batch. Settings alternate round by
round, so a noisy machine slows them alike.

    .venv/bin/python bench/long_prefill_share.py --thresholds none,64,128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from argosy_runtime import LLM, SamplingParams

LONG = "The history of the Roman Empire spans many centuries and many lands. " * 120
SHORT = ["What is the capital of France?", "Name three primary colors.", "Say hello.",
         "What is 2 + 2?"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def one_round(llm: LLM, tag: str) -> dict[str, list[float]]:
    engine = llm.engine
    start = time.perf_counter()
    for i in range(2):
        engine.add_request(f"{tag}-long{i}", f"{LONG}{i}", PARAMS)
    for i, prompt in enumerate(SHORT):
        engine.add_request(f"{tag}-short{i}", prompt, PARAMS)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    return {"long_ttft": [t for r, t in first.items() if "-long" in r],
            "short_ttft": [t for r, t in first.items() if "-short" in r],
            "total": [time.perf_counter() - start]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--thresholds", default="none,64,128")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    settings = args.thresholds.split(",")
    engines = {s: LLM(model="smollm2-135m", dtype="bfloat16", enable_prefix_caching=False,
                      max_num_batched_tokens=args.budget,
                      long_prefill_token_threshold=None if s == "none" else int(s))
               for s in settings}
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in settings}
    for llm in engines.values():
        one_round(llm, "warmup")
    for r in range(args.rounds):
        for s in settings:
            for key, values in one_round(engines[s], f"r{r}").items():
                samples[s].setdefault(key, []).extend(values)
    medians = {s: {k: round(statistics.median(v), 3) for k, v in m.items()}
               for s, m in samples.items()}
    print(f"budget {args.budget}, long prompt {len(engines[settings[0]].engine.tokenizer.encode(LONG))} "
          f"tokens, median of {args.rounds} rounds (s)")
    print(f"{'threshold':>10} {'short TTFT':>11} {'long TTFT':>10} {'total':>7}")
    for s, m in medians.items():
        print(f"{s:>10} {m['short_ttft']:>11} {m['long_ttft']:>10} {m['total']:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget": args.budget, "rounds": args.rounds, "medians": medians}, f,
                      indent=1)


if __name__ == "__main__":
    main()
