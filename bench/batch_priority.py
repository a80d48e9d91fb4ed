"""Live latency while a bulk job runs: the Batch API (low priority) against the same bulk
requests sent as ordinary concurrent requests, on argosy and optionally vLLM.

One server at a time on the same machine and model. Per server, three phases with the same
live load (streamed chat requests, Poisson arrivals):

  alone : live requests only
  bulk          : plus BULK completions sent at once as plain HTTP requests (what a bulk
                  client does against any OpenAI server: first come, first served)
  bulk-priority : the same, each with `priority: 1` (live requests have 0); vLLM runs with
                  `--scheduling-policy priority` for it
  batch         : the same completions as one Batch API job (argosy only; priority 1 too)

It prints, per phase, live TTFT p50/p90, the bulk job's wall time and its output tokens/s.

    python bench/batch_priority.py --json docs/benchmarks/batch/priority.json
    python bench/batch_priority.py --vllm /tmp/vllm-cli --vllm-model /tmp/smollm2-hf ...
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from argosy_runtime.benchmarks.processes import start_process, stop_process
from argosy_runtime.benchmarks.serve import (
    arrival_times,
    make_requests,
    percentile,
    send_one,
)

PHASES = ("alone", "bulk", "bulk-priority", "batch")


async def live_load(base: str, model: str, args: argparse.Namespace, delay: float,
                    seed: int) -> list[Any]:
    """Streamed chat requests at `args.live_rate`/s, starting `delay` s from now."""
    specs = make_requests("synthetic", args.live_requests, args.live_input, args.live_output,
                          seed)
    times = arrival_times(len(specs), args.live_rate, seed)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter() + delay

        async def fire(spec: Any, at: float) -> Any:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            payload = {"model": model, "messages": [{"role": "user", "content": spec.prompt}],
                       "max_tokens": spec.output_len, "temperature": 0, "stream": True,
                       "ignore_eos": True}
            return await send_one(client, base + "/v1/chat/completions", payload, chat=True)

        return list(await asyncio.gather(*(fire(s, t) for s, t in zip(specs, times,
                                                                      strict=True))))


def bulk_bodies(model: str, args: argparse.Namespace, seed: int,
                **extra: Any) -> list[dict[str, Any]]:
    specs = make_requests("synthetic", args.bulk, args.bulk_input, args.bulk_output, seed)
    return [{"model": model, "prompt": s.prompt, "max_tokens": s.output_len, "temperature": 0,
             "ignore_eos": True, **extra} for s in specs]


async def bulk_plain(base: str, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """Every bulk request at once over HTTP; (wall seconds, output tokens)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        responses = await asyncio.gather(*(client.post(base + "/v1/completions", json=b)
                                           for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses
                 if r.status_code == 200)
    return wall, tokens


async def bulk_batch(base: str, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """The same requests as one Batch API job; (wall seconds until completed, output tokens)."""
    lines = "".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                "body": b}) + "\n" for i, b in enumerate(bodies))
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()
        upload = await client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": ("bulk.jsonl", io.BytesIO(lines.encode()))})
        batch = (await client.post("/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})).json()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.2)
            batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
        wall = time.perf_counter() - t0
    assert batch["status"] == "completed", batch
    return wall, batch["usage"]["output_tokens"]


def summarize(phase: str, live: list[Any], bulk: tuple[float, int] | None) -> dict[str, Any]:
    ttfts = [r.ttft for r in live if r.ok]
    row: dict[str, Any] = {"phase": phase, "live_ok": len(ttfts), "live_total": len(live),
                           "ttft_p50_ms": 1000 * percentile(ttfts, 50),
                           "ttft_p90_ms": 1000 * percentile(ttfts, 90)}
    if bulk is not None:
        row.update(bulk_wall_s=bulk[0], bulk_tok_s=bulk[1] / bulk[0])
    return row


async def run_server(name: str, base: str, model: str, args: argparse.Namespace,
                     phases: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for phase in phases:
        # New prompts for every phase (same seeds on every server): a phase must not find
        # the previous one's prompts in the prefix cache.
        seed = args.seed + 1000 * PHASES.index(phase)
        if phase == "alone":
            live, bulk = await live_load(base, model, args, 0.0, seed), None
        else:
            if phase == "batch":
                job = bulk_batch(base, bulk_bodies(model, args, seed + 1))
            elif phase == "bulk":
                job = bulk_plain(base, bulk_bodies(model, args, seed + 1))
            else:
                job = bulk_plain(base, bulk_bodies(model, args, seed + 1, priority=1))
            # live requests start once the bulk job has filled the server
            live, bulk = await asyncio.gather(
                live_load(base, model, args, args.live_delay, seed), job)
        row = {"server": name, **summarize(phase, live, bulk)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--bulk", type=int, default=128, help="bulk requests")
    p.add_argument("--bulk-input", type=int, default=128)
    p.add_argument("--bulk-output", type=int, default=64)
    p.add_argument("--live-requests", type=int, default=12)
    p.add_argument("--live-rate", type=float, default=0.5)
    p.add_argument("--live-input", type=int, default=64)
    p.add_argument("--live-output", type=int, default=16)
    p.add_argument("--live-delay", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--vllm", default=None, help="a vllm command (e.g. /tmp/vllm-cli)")
    p.add_argument("--vllm-model", default=None, help="HF folder for vLLM")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    logs = Path("/tmp/batch_priority_logs")
    logs.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []

    cmd = [sys.executable, "-m", "argosy_runtime.cli.main", "serve", "--model", args.model,
           "--dtype", args.dtype, "--port", str(args.port),
           "--max-num-seqs", str(args.max_num_seqs)]
    proc = start_process(cmd, logs / "argosy.log", f"http://127.0.0.1:{args.port}/v1/models")
    try:
        rows += asyncio.run(run_server("argosy", base, args.model, args,
                                       PHASES))
    finally:
        stop_process(proc)
    if args.vllm:
        cmd = [args.vllm, "serve", args.vllm_model, "--port", str(args.port), "--dtype",
               args.dtype, "--max-num-seqs", str(args.max_num_seqs),
               "--served-model-name", args.model, "--gpu-memory-utilization", "0.25",
               "--scheduling-policy", "priority"]
        proc = start_process(cmd, logs / "vllm.log", f"http://127.0.0.1:{args.port}/v1/models")
        try:
            rows += asyncio.run(run_server("vllm", base, args.model, args,
                                           PHASES[:3]))
        finally:
            stop_process(proc)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
