"""Beam search over HTTP: `argosy serve` vs vLLM's OpenAI server, same model, same requests.

Each system is started in turn on the same port, warmed up, then sent the same `POST
/v1/completions` requests with `use_beam_search` (`n` = the beam width, `ignore_eos` so every
beam runs to `max_tokens` in both and neither stops early) by `--concurrency` client threads.
Every prompt is distinct, so prefix caches help only within a request's own beams. Reported
per system: wall seconds, requests/s, latency p50/p90; and how many requests' best
hypothesis is the same text in both (the two searches rank alike without end tokens: both
keep the width best of each step's extensions).

    .venv/bin/python bench/export_hf.py smollm2-135m /tmp/smollm2-hf
    .venv/bin/python bench/beam_search_serve.py --hf-model /tmp/smollm2-hf \
        --vllm-python /tmp/vllm/bin/python --requests 16 --width 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from rerank_serve import WORDS, start, wait_ready


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
            for i in range(count)]


def run(url: str, model: str, prompts: list[str], width: int, max_tokens: int,
        concurrency: int) -> dict:
    client = httpx.Client(base_url=url, timeout=1200)

    def one(prompt: str) -> tuple[float, list[str]]:
        start_s = time.perf_counter()
        resp = client.post("/v1/completions", json={
            "model": model, "prompt": prompt, "n": width, "max_tokens": max_tokens,
            "use_beam_search": True, "ignore_eos": True})
        resp.raise_for_status()
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        return time.perf_counter() - start_s, [c["text"] for c in choices]

    one("warm-up: " + prompts[0])
    start_s = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - start_s
    latencies = sorted(r[0] for r in results)
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall,
            "p50_s": statistics.median(latencies),
            "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "texts": [r[1] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="argosy's model")
    parser.add_argument("--hf-model", help="HF folder of the same weights (for vLLM)")
    parser.add_argument("--vllm-python", help="a Python with vLLM installed (its OpenAI server "
                        "module is run); left out, argosy only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--width", type=int, default=4, help="beam width (n)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18091)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    prompts = make_prompts(args.requests, args.seed)
    url = f"http://127.0.0.1:{args.port}"
    systems = {"argosy": [sys.executable, "-m", "argosy_runtime.cli.main", "serve",
                          "--model", args.model, "--dtype", args.dtype,
                          "--port", str(args.port), "--log-level", "warning"]}
    if args.vllm_python:
        if not args.hf_model:
            parser.error("--vllm-python needs --hf-model")
        systems["vllm"] = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", args.hf_model, "--dtype", args.dtype,
                           "--port", str(args.port), "--max-model-len", "2048",
                           "--served-model-name", args.model]
    results = {}
    logs = tempfile.mkdtemp(prefix="beam-bench-")
    for name, cmd in systems.items():
        log_path = os.path.join(logs, f"{name}.log")
        proc = start(cmd, log_path, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
        try:
            wait_ready(url, proc, log_path)
            results[name] = run(url, args.model, prompts, args.width, args.max_tokens,
                                args.concurrency)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        print(f"{name}: {results[name]['wall_s']:.2f} s", file=sys.stderr)

    base = results["argosy"]
    print(f"{args.requests} beam-search requests, width {args.width}, {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}, {args.dtype}")
    print("| system | wall s | requests/s | p50 s | p90 s | argosy's speed-up |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = "" if name == "argosy" else f"**{r['wall_s'] / base['wall_s']:.2f}x**"
        print(f"| {name} | {r['wall_s']:.2f} | {r['requests_per_s']:.2f} | {r['p50_s']:.2f} "
              f"| {r['p90_s']:.2f} | {ratio} |")
    if "vllm" in results:
        same = sum(a[0] == b[0] for a, b in zip(base["texts"], results["vllm"]["texts"]))
        print(f"best hypothesis identical in {same} of {args.requests} requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()
