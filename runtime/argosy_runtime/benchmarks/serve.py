"""`argosy bench serve`: an open-loop load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process at `--rate` requests/s (`inf`: all at once) whatever the
server's progress (open loop: a slow server builds a queue, as in production), each one a
streaming completion. Per rate it reports request throughput, output tokens/s, TTFT, inter-token
latency (ITL), time per output token and end-to-end latency percentiles, and failures, as a
table and a JSON file; `--plot` writes latency CDFs (and throughput/latency against rate when
several rates are given). `--compare A.json B.json ...` merges earlier runs (e.g. ours and
vLLM's) into one table and plot instead of running.

Prompts are made of common English words, one token each in the embedded model's tokenizer
with or without a leading space (a prompt's first word has none), so that `--input-len N`
prompts are N tokens there and the same prompts mean the same load on any server; the true
prompt/output token counts come from the server's `usage` (stream_options.include_usage).
`--ignore-eos` (default on) sends vLLM's `ignore_eos` extra so every request generates
exactly its output length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from argosy_runtime.benchmarks.arg_types import positive_int

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play food air away animal house point page letter"
).split()

DATASETS = ("synthetic", "synthetic-mixed", "shared-prefix")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestSpec:
    prompt: str
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


# ------------------------------------------------------------------ workload
def make_requests(dataset: str, num: int, input_len: int, output_len: int, seed: int,
                  prefix_len: int | None = None) -> list[RequestSpec]:
    """The prompts and output lengths of one run (deterministic in `seed`)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    rng = random.Random(seed)

    def words(n: int) -> list[str]:
        return [rng.choice(WORDS) for _ in range(n)]

    specs = []
    if dataset == "shared-prefix":
        # Each prompt is told apart by i written in base len(WORDS) with WORDS as digits, not
        # by the number i: " 12" is three tokens in digit-splitting tokenizers (SmolLM2's),
        # which made every prompt 1-2 tokens longer than --input-len.
        width = 1
        while len(WORDS) ** width < num:
            width += 1
        plen = min(input_len - width,
                   prefix_len if prefix_len is not None else input_len * 3 // 4)
        prefix = words(max(0, plen))
        for i in range(num):
            tag = [WORDS[i // len(WORDS) ** k % len(WORDS)] for k in range(width)]
            tail = words(input_len - len(prefix) - width)
            specs.append(RequestSpec(" ".join(prefix + tag + tail), output_len))
        return specs
    for _ in range(num):
        if dataset == "synthetic-mixed":  # lengths uniform in [0.25x, 1.75x]: mean x
            n_in = rng.randint(max(1, input_len // 4), max(1, input_len * 7 // 4))
            n_out = rng.randint(max(1, output_len // 4), max(1, output_len * 7 // 4))
        else:
            n_in, n_out = input_len, output_len
        specs.append(RequestSpec(" ".join(words(n_in)), n_out))
    return specs


def rate_seed(seed: int, rate_index: int) -> int:
    """The workload seed of the rate_index-th rate of a run (the first keeps `seed`)."""
    return seed + 7919 * rate_index


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    if num < 1:
        return []
    rng = random.Random(seed + 1)
    gaps = [rng.expovariate(rate) for _ in range(num - 1)]
    # Rescale the exponential gaps so that their mean is exactly 1/rate, as vLLM's
    # `vllm bench serve` does (its sends span exactly num/rate). Unscaled, the sum of a few
    # dozen gaps is off by ~1/sqrt(num): 32 prompts at rate 1 (seed 0) were all sent within
    # 25.7 s, an offered load of 1.25/s reported as the rate-1 row.
    scale = (num - 1) / rate / sum(gaps) if num > 1 and sum(gaps) > 0 else 1.0
    t, times = 0.0, [0.0]
    for gap in gaps:
        t += gap * scale
        times.append(t)
    return times


# -------------------------------------------------------------------- client
async def send_one(client: Any, url: str, payload: dict[str, Any], chat: bool) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {r.status_code}: {body}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return res
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else \
                        choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no tokens received"
    except Exception as exc:  # a benchmark records failures, it does not stop on them
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_rate(base_url: str, model: str, specs: list[RequestSpec], rate: float,
                   args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    import httpx

    chat = args.endpoint == "chat"
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    times = arrival_times(len(specs), rate, args.seed)
    async with httpx.AsyncClient(headers=headers, timeout=args.request_timeout,
                                 limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(spec: RequestSpec, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload: dict[str, Any] = {"model": model, "max_tokens": spec.output_len,
                                       "temperature": 0.0, "stream": True,
                                       "stream_options": {"include_usage": True}}
            if chat:
                payload["messages"] = [{"role": "user", "content": spec.prompt}]
            else:
                payload["prompt"] = spec.prompt
            if args.ignore_eos:
                payload["ignore_eos"] = True
            if sem is None:
                return await send_one(client, url, payload, chat)
            async with sem:
                return await send_one(client, url, payload, chat)

        results = await asyncio.gather(*(fire(s, t) for s, t in zip(specs, times, strict=True)))
        duration = time.perf_counter() - t0
    return list(results), duration


# ------------------------------------------------------------------- summary
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.e2e is not None and r.ttft is not None and r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "rate": "inf" if math.isinf(rate) else rate,
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for name, values in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2e", e2es)):
        summary[f"mean_{name}_s"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            summary[f"p{q}_{name}_s"] = percentile(values, q)
    summary["samples"] = {"ttft": ttfts, "itl": itls, "e2e": e2es}
    return summary


def format_table(rows: list[dict[str, Any]], label_key: str | None = None) -> str:
    cols = [("rate", "rate/s", "{}"), ("completed", "done", "{}"), ("failed", "failed", "{}"),
            ("request_throughput", "req/s", "{:.2f}"), ("output_tokens_per_s", "out tok/s",
                                                        "{:.1f}"),
            ("p50_ttft_s", "TTFT p50 ms", "ms"), ("p90_ttft_s", "p90", "ms"),
            ("p99_ttft_s", "p99", "ms"), ("p50_itl_s", "ITL p50 ms", "ms"),
            ("p90_itl_s", "p90", "ms"), ("p99_itl_s", "p99", "ms"),
            ("p50_e2e_s", "E2E p50 s", "{:.2f}")]
    if label_key:
        cols.insert(0, (label_key, "server", "{}"))

    def fmt(v: Any, spec: str) -> str:
        if v is None:
            return "-"
        if spec == "ms":
            return f"{v * 1000:.1f}"
        return spec.format(v)

    header = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [header, sep]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k), spec) for k, _, spec in cols) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Latency CDFs per server and rate; with several rates also metrics against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi_rate = any(len(rows) > 1 for rows in runs.values())
    ncols = 3 if multi_rate else 2
    nrows = 2 if multi_rate else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), squeeze=False)
    for label, rows in runs.items():
        for row in rows:
            tag = f"{label} @ {row['rate']}/s"
            for ax, key in ((axes[0][0], "ttft"), (axes[0][1], "itl")):
                xs = sorted(row["samples"][key])
                if xs:
                    ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                            label=tag)
        if multi_rate:
            rates = [float(r["rate"]) if r["rate"] != "inf" else float("nan") for r in rows]
            finite = [(x, r) for x, r in zip(rates, rows, strict=True) if not math.isnan(x)]
            xs = [x for x, _ in finite]
            axes[0][2].plot(xs, [r["output_tokens_per_s"] for _, r in finite], "o-", label=label)
            axes[1][0].plot(xs, [(r["p50_ttft_s"] or 0) * 1000 for _, r in finite], "o-",
                            label=f"{label} p50")
            axes[1][0].plot(xs, [(r["p99_ttft_s"] or 0) * 1000 for _, r in finite], "x--",
                            label=f"{label} p99")
            axes[1][1].plot(xs, [(r["p50_itl_s"] or 0) * 1000 for _, r in finite], "o-",
                            label=f"{label} p50")
            axes[1][1].plot(xs, [(r["p99_itl_s"] or 0) * 1000 for _, r in finite], "x--",
                            label=f"{label} p99")
            axes[1][2].plot(xs, [r["request_throughput"] for _, r in finite], "o-", label=label)
    titles = [("TTFT CDF", "ms"), ("inter-token latency CDF", "ms")]
    if multi_rate:
        titles += [("output tokens/s vs rate", "request rate /s"), ("TTFT vs rate (ms)",
                   "request rate /s"), ("ITL vs rate (ms)", "request rate /s"),
                   ("completed requests/s vs rate", "request rate /s")]
    for ax, (title, xlabel) in zip([a for row in axes for a in row], titles, strict=False):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--api-key", default=os.environ.get("ARGOSY_API_KEY")
                        or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--rate", default="4", help="requests/s, comma-separated for several "
                        "runs; 'inf' sends all at once (default: %(default)s)")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic")
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--prefix-len", type=int, default=None,
                        help="shared-prefix: words shared by every prompt (default 3/4 of "
                             "--input-len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send vLLM's ignore_eos extra (exact output lengths)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="send N short requests first, not measured (a cold server's "
                             "first request pays one-time costs); a failed one stops the run "
                             "before it starts, naming the error (default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--label", default=None, help="name of the server in tables and plots")
    parser.add_argument("--json", dest="json_path", default="bench_serve_results.json")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--compare", nargs="+", default=None, metavar="RESULT.json",
                        help="do not run: merge earlier result files into one table/plot")
    parser.add_argument("--markdown", default=None, help="also write the table here")


def _parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:  # "abc": float's own message named neither the flag nor the rule
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"--rate values must be numbers > 0 or inf, got {part!r}")
        rates.append(rate)
    return rates


def _discover_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _write_outputs(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
                   config: dict[str, Any]) -> None:
    rows = [{**row, "server": label} for label, rs in runs.items() for row in rs]
    table = format_table(rows, label_key="server" if len(runs) > 1 else None)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": config, "runs": runs}, f, indent=1)
        print(f"results: {args.json_path}", file=sys.stderr)
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        runs: dict[str, list[dict[str, Any]]] = {}
        for path in args.compare:
            with open(path) as f:
                data = json.load(f)
            for label, rows in data["runs"].items():
                # Two runs under one label (the default label is the served model's name,
                # often the same for ours and vLLM's) must not silently replace each other:
                # the later one is named after its file too.
                key = label
                while key in runs:
                    key = f"{key} ({os.path.basename(path)})"
                runs[key] = rows
        _write_outputs(runs, args, {"compare": args.compare})
        return 0
    try:
        if args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        rates = _parse_rates(args.rate)
        # Each rate its own prompts: with one set for all, every rate after the first would
        # find its prompts in the server's prefix cache and measure cache hits, not prefill.
        workloads = [make_requests(args.dataset, args.num_prompts, args.input_len,
                                   args.output_len, rate_seed(args.seed, i), args.prefix_len)
                     for i in range(len(rates))]
    except ValueError as exc:
        print(f"argosy bench serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        model = args.model or _discover_model(args.base_url, args.api_key)
    except Exception as exc:
        print(f"argosy bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    if args.warmup > 0:
        # Its own prompt, not one of the workload's: those must reach the server uncached.
        warmup = [RequestSpec("Warm up: say something.", min(8, args.output_len))] * args.warmup
        results, _ = asyncio.run(run_rate(args.base_url, model, warmup, math.inf, args))
        failed = [r.error for r in results if not r.ok]
        if failed:
            print(f"argosy bench serve: the warm-up request failed: {failed[0]}",
                  file=sys.stderr)
            return 1
    label = args.label or model
    rows = []
    for rate, specs in zip(rates, workloads):
        results, duration = asyncio.run(run_rate(args.base_url, model, specs, rate, args))
        row = summarize(results, duration, rate)
        rows.append(row)
        print(f"rate {row['rate']}: {row['completed']}/{row['num_requests']} ok in "
              f"{duration:.1f}s", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "api_key"
              and isinstance(v, (str, int, float, bool, type(None), list))}
    config["model"] = model
    _write_outputs({label: rows}, args, config)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


__all__ = ["add_arguments", "run", "make_requests", "rate_seed", "arrival_times", "summarize",
           "RequestResult"]
