"""Reranking over HTTP: `argosy serve` vs `vllm serve --runner pooling`, same model, same requests.

Each system is started in turn on the same port, warmed up, then sent the same `POST
/v1/rerank` requests (a query and `--docs` documents each, every document text distinct so
prefix caches do not help) by `--concurrency` client threads. Reported per system: wall
seconds, requests/s, documents/s, latency p50/p90; and the largest difference between the
two systems' relevance scores for the same (query, document), so both rank with the same
function: the cosine of last-token, L2-normalized embeddings for an embedding model, the
sigmoid of a one-label head over the (query, document) pair for a cross-encoder
(`*ForSequenceClassification`; pass its folder as both --model and --hf-model).

    .venv/bin/python bench/export_hf.py smollm2-135m /tmp/smollm2-hf
    .venv/bin/python bench/rerank_serve.py --hf-model /tmp/smollm2-hf \
        --vllm-python /tmp/vllm/bin/python --requests 48 --docs 16 --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = ("the model serves tokens from a paged cache while batches of requests share each "
         "weight read and the scheduler admits prompts in chunks so decoding never stalls "
         "kubernetes operators reconcile deployments into pods gateways route by prefix").split()


def make_requests(count: int, docs: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"query": f"{i}: " + text(8, 24),
             "documents": [f"{i}.{j}: " + text(40, 160) for j in range(docs)]}
            for i in range(count)]


def start(cmd: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 (the server's lifetime)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited ({proc.returncode}); log: {log_path}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"server not ready after {timeout:.0f} s; log: {log_path}")


def run(url: str, model: str, requests: list[dict], concurrency: int) -> dict:
    client = httpx.Client(base_url=url, timeout=600)

    def one(body: dict) -> tuple[float, list[float]]:
        start = time.perf_counter()
        resp = client.post("/v1/rerank", json={"model": model, **body})
        resp.raise_for_status()
        scores = [0.0] * len(body["documents"])
        for r in resp.json()["results"]:
            scores[r["index"]] = r["relevance_score"]
        return time.perf_counter() - start, scores

    one(requests[0])  # warm-up (its texts are sent again below, so caches get a head start
    one(requests[-1])  # of two requests out of all: noted in the results)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, requests))
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    docs = sum(len(r["documents"]) for r in requests)
    return {"wall_s": wall, "requests_per_s": len(requests) / wall, "docs_per_s": docs / wall,
            "p50_s": statistics.median(latencies),
            "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "scores": [r[1] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="argosy's model")
    parser.add_argument("--hf-model", help="HF folder of the same weights (for vLLM)")
    parser.add_argument("--vllm-python", help="a Python with vLLM installed (its OpenAI server "
                        "module is run); left out, argosy only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--docs", type=int, default=16, help="documents per request")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="both servers' --max-model-len (512 for a BERT cross-encoder)")
    parser.add_argument("--truncate-prompt-tokens", type=int, default=None,
                        help="sent with every request: each (query, document) prompt keeps "
                             "its last k tokens (both servers' field)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    requests = make_requests(args.requests, args.docs, args.seed)
    if args.truncate_prompt_tokens is not None:
        for body in requests:
            body["truncate_prompt_tokens"] = args.truncate_prompt_tokens
    url = f"http://127.0.0.1:{args.port}"
    systems = {"argosy": ([sys.executable, "-m", "argosy_runtime.cli.main", "serve",
                           "--model", args.model, "--dtype", args.dtype,
                           "--port", str(args.port), "--log-level", "warning",
                           "--max-model-len", str(args.max_model_len)], args.model)}
    if args.vllm_python:
        if not args.hf_model:
            parser.error("--vllm-python needs --hf-model")
        systems["vllm"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                            "--model", args.hf_model, "--runner", "pooling",
                            "--dtype", args.dtype, "--port", str(args.port),
                            "--max-model-len", str(args.max_model_len),
                            "--served-model-name", args.model],
                           args.model)
    results = {}
    logs = tempfile.mkdtemp(prefix="rerank-bench-")
    for name, (cmd, model) in systems.items():
        log_path = os.path.join(logs, f"{name}.log")
        proc = start(cmd, log_path, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
        try:
            wait_ready(url, proc, log_path)
            results[name] = run(url, model, requests, args.concurrency)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        print(f"{name}: {results[name]['wall_s']:.2f} s", file=sys.stderr)

    base = results["argosy"]
    print(f"{args.requests} rerank requests x {args.docs} documents, concurrency "
          f"{args.concurrency}, {args.dtype}")
    print("| system | wall s | requests/s | documents/s | p50 s | p90 s | argosy's speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = "" if name == "argosy" else f"**{r['wall_s'] / base['wall_s']:.2f}x**"
        print(f"| {name} | {r['wall_s']:.2f} | {r['requests_per_s']:.2f} | {r['docs_per_s']:.1f} "
              f"| {r['p50_s']:.2f} | {r['p90_s']:.2f} | {ratio} |")
    if "vllm" in results:
        diff = max(abs(a - b) for x, y in zip(base["scores"], results["vllm"]["scores"])
                   for a, b in zip(x, y))
        print(f"largest relevance-score difference argosy vs vllm: {diff:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()
