"""What the gateway's small-to-big cascade costs and keeps: latency, throughput and agreement
with the large model's answers, with the small model's confidence deciding.

Only one model is embedded (smollm2-135m), so the "small" and "large" models are a cheap and an
expensive variant of it: small = `--quantization int4` (plus --small-kv-cache-dtype), large =
`--dtype float32` (--large-dtype). Starts one `argosy serve` replica of each (served as `small`
and `large`, --cpu-threads each, prefix caching off: every arm sends the same prompts, and
each should prefill them afresh) and an `argosy gateway` in front of them with a cascade route
`auto` (docs/gateway.md, "Cascade (small-to-big)") that has no up-front rules, so only the
confidence check (`min_mean_logprob`) decides.

The same seeded mix of short greedy non-streamed chat prompts (plain facts and continuations,
and open-ended writing) is sent through the gateway by --concurrency closed-loop workers in
each arm: `large` (every request to the large model), `small` (every request to the small
one), then `auto` once per --thresholds value (the gateway restarts with that threshold).
Every request asks for logprobs, so every arm returns its tokens, and the `small` arm's own
mean logprobs predict what the cascade will decide.

Reported per arm: latency mean/p50/p90, requests/s, the fraction answered by each tier (the
gateway's `x-argosy-cascade` header; checked against its decision counter), and quality as
agreement with the `large` arm's answers: exact text match, and token prefix agreement (the
common leading tokens over the longer of the two answers, averaged).

    python bench/cascade.py --json docs/benchmarks/cascade/cascade.json
    python bench/cascade.py --thresholds=-0.3,-0.6 --large-dtype bfloat16

Nothing here needs a GPU (docs/benchmarks/cascade.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml
from argosy_runtime.benchmarks.processes import start_process, stop_process
from argosy_runtime.benchmarks.results import utc_now, write_results
from argosy_runtime.benchmarks.serve import percentile

ROUTE = "auto"
DECISIONS = "argosy:gateway_cascade_decisions_total"

# Short prompts a 135M model answers in a few tokens, and open-ended ones where it rambles:
# the mix the confidence check has to tell apart.
EASY = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "How many days are in a week?",
    "What color is the sky on a clear day?",
    "Complete the sequence: one, two, three, four,",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "How many legs does a dog have?",
    "What is the first letter of the English alphabet?",
    "Translate 'hello' into Spanish.",
    "What is the boiling point of water in degrees Celsius?",
    "Name the largest ocean on Earth.",
]
HARD = [
    "Write a short poem about a lighthouse keeper who has never seen the sea.",
    "Explain why the sky is blue to a five-year-old, then to a physicist.",
    "Invent a name and a backstory for a dragon that is afraid of fire.",
    "Describe a city in the year 2300 in three sentences.",
    "What would happen if humans could photosynthesize? Discuss the consequences.",
    "Give three arguments for and three against homework in primary school.",
    "Write the opening line of a mystery novel set on a train in the Alps.",
    "Summarize the plot of a made-up opera about a clockmaker and a storm.",
    "Propose an unusual use for a paperclip and explain how it works.",
    "Compare the philosophies of stoicism and existentialism in a paragraph.",
    "Tell a joke about a mathematician and a baker, then explain it.",
    "Design a board game for two players that uses only a deck of cards.",
]


def parse_thresholds(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v > 0 for v in values):
        raise argparse.ArgumentTypeError("thresholds: one or more numbers <= 0")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--small-quantization", default="int4",
                   help="the small replica's --quantization (default int4)")
    p.add_argument("--small-kv-cache-dtype", default="auto",
                   help="the small replica's --kv-cache-dtype (default auto)")
    p.add_argument("--large-dtype", default="float32",
                   help="the large replica's --dtype (default float32)")
    p.add_argument("--thresholds", type=parse_thresholds, default=[-0.6, -0.7, -0.9],
                   help="min_mean_logprob per cascade arm, comma-separated "
                        "(default -0.6,-0.7,-0.9)")
    p.add_argument("--requests", type=int, default=24, help="requests per arm")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cpu-threads", type=int, default=1, help="each replica's --cpu-threads")
    p.add_argument("--port", type=int, default=8170,
                   help="the gateway's port; the small and large replicas take the next two")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="folder for configs and logs")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens", "cpu_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def request_mix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The chat requests of every arm: half easy, half hard, in a seeded order; `model` is
    set per arm. logprobs are asked for so that every arm returns its tokens."""
    rng = random.Random(args.seed)
    prompts = [(EASY if i % 2 == 0 else HARD)[(i // 2) % len(EASY)]
               for i in range(args.requests)]
    rng.shuffle(prompts)
    return [{"messages": [{"role": "user", "content": p}], "max_tokens": args.max_tokens,
             "temperature": 0, "logprobs": True, "stream": False} for p in prompts]


def gateway_config(args: argparse.Namespace, small_url: str, large_url: str,
                   threshold: float | None) -> dict[str, Any]:
    """The gateway's YAML config (docs/gateway.md): both models, and the cascade route with
    no up-front rules, so only the confidence check sends a request to the large model."""
    cascade: dict[str, Any] = {"name": ROUTE, "small": "small", "large": "large"}
    if threshold is not None:
        cascade["min_mean_logprob"] = threshold
    return {
        "host": "127.0.0.1", "port": args.port,
        "models": [{"name": "small", "backends": [small_url]},
                   {"name": "large", "backends": [large_url]}],
        "cascades": [cascade],
    }


def answer_tokens(answer: dict[str, Any]) -> tuple[str, list[str], float | None]:
    """The first choice's text, its tokens and their mean logprob (None without logprobs)."""
    choice = answer["choices"][0]
    content = ((choice.get("logprobs") or {}).get("content")) or []
    tokens = [e["token"] for e in content]
    values = [e["logprob"] for e in content]
    mean = sum(values) / len(values) if values else None
    return choice["message"]["content"] or "", tokens, mean


def prefix_agreement(tokens: list[str], reference: list[str]) -> float:
    """Leading tokens in common over the longer answer's length (1.0 for two empty ones)."""
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(tokens, reference, strict=False):
        if a != b:
            break
        same += 1
    return same / longest


def metric_counts(text: str, name: str) -> dict[str, float]:
    """Prometheus samples of `name` by their `tier/reason` labels."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}}\s+(\S+)", text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[f"{pairs.get('tier')}/{pairs.get('reason')}"] = float(value)
    return out


async def send_mix(gateway: str, model: str, bodies: list[dict[str, Any]],
                   concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """Send `bodies` as `model` with `concurrency` closed-loop workers: one record per request
    (in the order of `bodies`), and the wall time."""
    records: list[dict[str, Any]] = [{} for _ in bodies]
    queue = list(range(len(bodies)))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            start = time.perf_counter()
            try:
                r = await client.post(gateway + "/v1/chat/completions",
                                      json=dict(bodies[i], model=model))
                latency = time.perf_counter() - start
                if r.status_code != 200:
                    records[i] = {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
                    continue
                text, tokens, mean = answer_tokens(r.json())
                confidence = r.headers.get("x-argosy-cascade-confidence")
                records[i] = {
                    "ok": True, "latency_s": latency, "text": text, "tokens": tokens,
                    "mean_logprob": mean, "tier": r.headers.get("x-argosy-cascade", model),
                    "reason": r.headers.get("x-argosy-cascade-reason"),
                    "confidence": float(confidence) if confidence is not None else None,
                }
            except httpx.HTTPError as exc:  # a benchmark records failures
                records[i] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return records, time.perf_counter() - t0


def summarize(arm: str, records: list[dict[str, Any]], wall: float,
              reference: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's row: latency, throughput, tiers and agreement with `reference` (the large
    arm's records, request by request)."""
    ok = [(r, ref) for r, ref in zip(records, reference, strict=True) if r.get("ok")]
    latencies = [r["latency_s"] for r, _ in ok]
    tiers = Counter(r["tier"] for r, _ in ok)
    compared = [(r, ref) for r, ref in ok if ref.get("ok")]

    def ms(q: float) -> float | None:
        v = percentile(latencies, q)
        return None if v is None else 1000 * v

    return {
        "arm": arm, "ok": len(ok), "total": len(records),
        "errors": sorted({r["error"] for r in records if not r.get("ok")})[:3],
        "latency_mean_ms": 1000 * statistics.fmean(latencies) if latencies else None,
        "latency_p50_ms": ms(50), "latency_p90_ms": ms(90),
        "requests_per_s": len(ok) / wall if wall > 0 else None, "wall_s": wall,
        "small_fraction": tiers["small"] / len(ok) if ok else None,
        "large_fraction": tiers["large"] / len(ok) if ok else None,
        "reasons": dict(Counter(f"{r['tier']}/{r['reason']}" for r, _ in ok if r["reason"])),
        "exact_match": (sum(r["text"] == ref["text"] for r, ref in compared) / len(compared)
                        if compared else None),
        "prefix_agreement": (statistics.fmean(prefix_agreement(r["tokens"], ref["tokens"])
                                              for r, ref in compared) if compared else None),
        "output_tokens_mean": (statistics.fmean(len(r["tokens"]) for r, _ in ok)
                               if ok else None),
        "load_avg": os.getloadavg()[0],
    }


def predicted_small_fraction(small: list[dict[str, Any]], threshold: float) -> float | None:
    """The fraction the cascade should leave with the small model at `threshold`, from the
    small arm's own mean logprobs (greedy: the cascade's small answers are the same ones)."""
    means = [r["mean_logprob"] for r in small if r.get("ok") and r["mean_logprob"] is not None]
    return sum(m >= threshold for m in means) / len(means) if means else None


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| arm | ok | latency mean / p50 / p90 ms | req/s | small / large | "
             "exact match | token prefix agreement |", "|" + "---|" * 7]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"

    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['ok']}/{r['total']} | {r['latency_mean_ms']:.0f} / "
            f"{r['latency_p50_ms']:.0f} / {r['latency_p90_ms']:.0f} | "
            f"{r['requests_per_s']:.2f} | {pct(r['small_fraction'])} / "
            f"{pct(r['large_fraction'])} | {pct(r['exact_match'])} | "
            f"{r['prefix_agreement']:.2f} |")
    return "\n".join(lines)


def run_gateway(args: argparse.Namespace, config: dict[str, Any], logs: Path, tag: str,
                argosy: list[str], model: str, bodies: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    """Start the gateway with `config`, send the mix as `model`, return the records, the wall
    time and the gateway's cascade decision counts."""
    path = logs / f"gateway-{tag}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    gateway = f"http://127.0.0.1:{args.port}"
    gw = start_process(argosy + ["gateway", "--config", str(path)], logs / f"gateway-{tag}.log",
                       gateway + "/ready", timeout=60)
    try:
        records, wall = asyncio.run(send_mix(gateway, model, bodies, args.concurrency))
        decisions = metric_counts(httpx.get(gateway + "/metrics", timeout=10).text, DECISIONS)
    finally:
        stop_process(gw)
    return records, wall, decisions


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="cascade."))
    logs.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    argosy = [sys.executable, "-m", "argosy_runtime.cli.main"]
    small_url = f"http://127.0.0.1:{args.port + 1}"
    large_url = f"http://127.0.0.1:{args.port + 2}"
    engines = {
        "small": ["--quantization", args.small_quantization,
                  "--kv-cache-dtype", args.small_kv_cache_dtype],
        "large": ["--dtype", args.large_dtype],
    }
    print(f"logs and configs in {logs}; load average {os.getloadavg()}", flush=True)
    bodies = request_mix(args)
    replicas = []
    rows: list[dict[str, Any]] = []
    records: dict[str, list[dict[str, Any]]] = {}
    try:
        for (name, flags), url in zip(engines.items(), (small_url, large_url), strict=True):
            port = url.rsplit(":", 1)[1]
            # Prefix caching off: later arms would find the earlier arms' prompts cached.
            cmd = ["serve", "--model", args.model, "--served-model-name", name, "--port", port,
                   "--cpu-threads", str(args.cpu_threads), "--no-enable-prefix-caching", *flags]
            replicas.append(start_process(argosy + cmd, logs / f"replica-{name}.log",
                                          url + "/ready"))
        for name, url in (("small", small_url), ("large", large_url)):
            # The first steps of a fresh process are slower: warm both up outside the timing.
            httpx.post(url + "/v1/chat/completions", timeout=300, json=dict(
                bodies[0], model=name))
        arms = [("large", "large", None), ("small", "small", None)]
        arms += [(f"{ROUTE} {t:g}", ROUTE, t) for t in args.thresholds]
        for arm, model, threshold in arms:
            config = gateway_config(args, small_url, large_url, threshold)
            recs, wall, decisions = run_gateway(args, config, logs, arm.replace(" ", ""),
                                                argosy, model, bodies)
            records[arm] = recs
            row = summarize(arm, recs, wall, records["large"])
            row["threshold"] = threshold
            row["gateway_decisions"] = decisions
            if threshold is not None:
                row["predicted_small_fraction"] = predicted_small_fraction(
                    records["small"], threshold)
            print({k: v for k, v in row.items()}, flush=True)
            rows.append(row)
    finally:
        for proc in replicas:
            stop_process(proc)
    means = [r["mean_logprob"] for r in records.get("small", []) if r.get("ok")]
    print()
    print(format_table(rows))
    if args.json:
        write_results(args.json, "bench/cascade.py", sys.argv[1:] if argv is None else argv,
                      started, args, rows=rows,
                      small_mean_logprobs=means,
                      requests=[{"prompt": b["messages"][0]["content"],
                                 **{arm: {k: recs[i].get(k) for k in
                                          ("text", "tier", "reason", "confidence",
                                           "mean_logprob", "latency_s")}
                                    for arm, recs in records.items()}}
                                for i, b in enumerate(bodies)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
