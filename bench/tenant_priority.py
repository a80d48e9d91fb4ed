"""What a gateway tenant's `priority` buys: interactive latency beside a bulk tenant that
keeps the replica full, with the bulk tenant at the default priority (A) and at a larger one
(B), side by side in one invocation.

One real `argosy serve` replica and, per phase, an `argosy gateway` in front of it (the same
replica throughout; only the gateway is restarted, with a new config) with two tenants whose
keys are inline in a temporary YAML file:

  interactive : no priority (0): short streamed chat requests
  bulk        : K closed-loop streams of long completions (ignore_eos), K >= --max-num-seqs,
                so the replica's batch is always full and bulk requests wait for slots

Phases (each with prompts of its own, so none finds another's in the prefix cache):

  alone       : the interactive requests only (the gateway of A), for reference
  A-no-prio   : bulk tenant without `priority`: everything first come, first served
  B-prio      : bulk tenant with `priority: <--bulk-priority>`: the gateway sets it on the
                bulk tenant's requests, and the replica admits interactive requests first and
                preempts a running bulk request for them (it is recomputed later)

In A and B the bulk streams start first; once the replica runs --max-num-seqs requests, the
bulk tenant's output tokens/s is measured alone for --settle seconds, then the interactive
requests are sent (Poisson arrivals at --interactive-rate/s, or one at a time with
--interactive-rate 0) and the bulk tokens received while they run give "bulk tok/s".
Preemptions are the change of the replica's `argosy:num_preemptions_total` over the phase.
With --rounds N, A and B alternate N times (A, B, A, B, ...) and the ratios are medians of
the per-round ratios. "other procs' cores" is how many cores processes other than the
replica, the gateway and this script kept busy while the interactive requests ran
(/proc/stat): the noise of a shared machine.

    python bench/tenant_priority.py --json docs/benchmarks/tenants/priority.json
    python bench/tenant_priority.py --max-num-seqs 4 --bulk-streams 8 --interactive 20

Nothing here needs a GPU; on a CPU the absolute times are the machine's, the ratios are the
point (docs/benchmarks/tenants.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from argosy_runtime.benchmarks.processes import start_process, stop_process
from argosy_runtime.benchmarks.prometheus_text import metric_sum
from argosy_runtime.benchmarks.results import utc_now, write_results
from argosy_runtime.benchmarks.serve import (
    RequestResult,
    arrival_times,
    make_requests,
    percentile,
    send_one,
)

INTERACTIVE_KEY = "sk-bench-interactive"
BULK_KEY = "sk-bench-bulk"
PHASES = ("alone", "A-no-prio", "B-prio")


# ------------------------------------------------------------------ config
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("replica")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-num-seqs", type=int, default=4,
                   help="the replica's batch size (default 4): --bulk-streams fill it")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="the replica's --cpu-threads (default 1: on a small shared machine a "
                        "2-thread replica slows down many times over whenever another process "
                        "takes a core, since its OpenMP threads wait for each other; one "
                        "thread only shares its core); 0: the replica's default")
    g.add_argument("--replica-port", type=int, default=8131)
    g.add_argument("--gateway-port", type=int, default=8132)
    g = p.add_argument_group("bulk tenant")
    g.add_argument("--bulk-streams", type=int, default=8,
                   help="concurrent bulk streams, each sending its next request when the last "
                        "ends (default 8; at least --max-num-seqs)")
    g.add_argument("--bulk-input", type=int, default=64, help="words per bulk prompt")
    g.add_argument("--bulk-output", type=int, default=128,
                   help="tokens per bulk answer (ignore_eos; default 128)")
    g.add_argument("--bulk-priority", type=int, default=5,
                   help="the bulk tenant's `priority` in phase B (default 5)")
    g.add_argument("--settle", type=float, default=8.0,
                   help="seconds of bulk alone (measured) before interactive requests start")
    g = p.add_argument_group("interactive tenant")
    g.add_argument("--interactive", type=int, default=16,
                   help="interactive requests per phase (default 16)")
    g.add_argument("--interactive-rate", type=float, default=0.5,
                   help="Poisson arrivals per second (default 0.5); 0: one at a time")
    g.add_argument("--interactive-input", type=int, default=32, help="words per chat message")
    g.add_argument("--interactive-output", type=int, default=16,
                   help="tokens per answer (ignore_eos; default 16)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat A and B this many times, alternating (default 1)")
    p.add_argument("--no-alone", action="store_true",
                   help="skip the interactive-only reference phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="folder for the server logs (default: temp)")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.bulk_streams < args.max_num_seqs:
        p.error("--bulk-streams must be >= --max-num-seqs, or the bulk tenant cannot fill "
                "the replica")
    for name in ("max_num_seqs", "interactive", "rounds", "bulk_input", "bulk_output",
                 "interactive_input", "interactive_output"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.interactive_rate < 0 or args.settle < 0 or args.cpu_threads < 0:
        p.error("--interactive-rate, --settle and --cpu-threads must be >= 0")
    return args


def gateway_config(args: argparse.Namespace, replica_url: str,
                   bulk_priority: int | None) -> dict[str, Any]:
    """The gateway's YAML config (docs/gateway.md) for one phase."""
    bulk: dict[str, Any] = {"name": "bulk", "api_keys": [BULK_KEY]}
    if bulk_priority is not None:
        bulk["priority"] = bulk_priority
    return {
        "host": "127.0.0.1",
        "port": args.gateway_port,
        "health": {"interval_s": 1, "timeout_s": 2},
        "models": [{"name": args.model, "backends": [replica_url]}],
        "tenants": [{"name": "interactive", "api_keys": [INTERACTIVE_KEY]}, bulk],
    }


def write_gateway_config(path: Path, args: argparse.Namespace, replica_url: str,
                         bulk_priority: int | None) -> Path:
    path.write_text(yaml.safe_dump(gateway_config(args, replica_url, bulk_priority),
                                   sort_keys=False))
    return path


def cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy (all cores, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """Seconds of CPU time one process has used (user + system), 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """How many cores other processes (not the replica, the gateway or this script) kept
    busy: the noise on a shared machine, measured rather than guessed from the load average."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0, self.busy0, self.ours0 = time.perf_counter(), cpu_busy_s(), self._ours()

    def _ours(self) -> float:
        return sum(process_cpu_s(p) for p in self.pids)

    def read(self) -> dict[str, float]:
        dt = time.perf_counter() - self.t0
        ours = self._ours() - self.ours0
        other = cpu_busy_s() - self.busy0 - ours
        return {"ours_cores": ours / dt, "other_cores": max(0.0, other) / dt}


# ------------------------------------------------------------------ workload
@dataclass
class Bulk:
    token_times: list[float] = field(default_factory=list)
    completed: int = 0
    errors: list[str] = field(default_factory=list)

    def tok_s(self, t0: float, t1: float) -> float | None:
        if t1 <= t0:
            return None
        return sum(1 for t in self.token_times if t0 <= t < t1) / (t1 - t0)


async def bulk_stream(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
                      worker: int, streams: int, bulk: Bulk) -> None:
    """One closed-loop bulk stream: the next request as soon as the last one ends."""
    i = worker
    while True:
        body = bodies[i % len(bodies)]
        i += streams
        try:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    bulk.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    await asyncio.sleep(0.5)
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        bulk.token_times.append(time.perf_counter())
            bulk.completed += 1
        except httpx.HTTPError as exc:
            bulk.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.5)


async def replica_metrics(client: httpx.AsyncClient, replica_url: str) -> str:
    return (await client.get(replica_url + "/metrics")).text


async def wait_replica(client: httpx.AsyncClient, replica_url: str, *, running_at_least: int
                       | None = None, idle: bool = False, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = await replica_metrics(client, replica_url)
        running = metric_sum(text, "argosy:num_requests_running") or 0
        waiting = metric_sum(text, "argosy:num_requests_waiting") or 0
        if running_at_least is not None and running >= running_at_least:
            return
        if idle and running == 0 and waiting == 0:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"replica not {'idle' if idle else 'full'} after {timeout} s")


async def interactive_load(gateway: str, args: argparse.Namespace,
                           seed: int) -> list[RequestResult]:
    specs = make_requests("synthetic", args.interactive, args.interactive_input,
                          args.interactive_output, seed)
    headers = {"Authorization": f"Bearer {INTERACTIVE_KEY}"}
    url = gateway + "/v1/chat/completions"

    def payload(prompt: str, n: int) -> dict[str, Any]:
        return {"model": args.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}

    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        if args.interactive_rate == 0:
            return [await send_one(client, url, payload(s.prompt, s.output_len), chat=True)
                    for s in specs]
        times = arrival_times(len(specs), args.interactive_rate, seed)
        t0 = time.perf_counter()

        async def fire(prompt: str, n: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await send_one(client, url, payload(prompt, n), chat=True)

        return list(await asyncio.gather(*(fire(s.prompt, s.output_len, t)
                                           for s, t in zip(specs, times, strict=True))))


async def run_phase(phase: str, gateway: str, replica_url: str, args: argparse.Namespace,
                    round_: int, pids: list[int]) -> dict[str, Any]:
    seed = args.seed + 1000 * PHASES.index(phase) + 100 * round_
    row: dict[str, Any] = {"phase": phase, "round": round_,
                           "load_avg_start": os.getloadavg()[0]}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=30) as probe:
        pre = metric_sum(await replica_metrics(probe, replica_url),
                         "argosy:num_preemptions_total")
        bulk, tasks = Bulk(), []
        t_settle = t_start = time.perf_counter()
        bulk_client = httpx.AsyncClient(headers={"Authorization": f"Bearer {BULK_KEY}"},
                                        timeout=3600, limits=limits)
        try:
            if phase != "alone":
                specs = make_requests("synthetic", 50 * args.bulk_streams, args.bulk_input,
                                      args.bulk_output, seed + 1)
                bodies = [{"model": args.model, "prompt": s.prompt, "max_tokens": s.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True} for s in specs]
                tasks = [asyncio.create_task(bulk_stream(bulk_client,
                                                         gateway + "/v1/completions", bodies,
                                                         w, args.bulk_streams, bulk))
                         for w in range(args.bulk_streams)]
                await wait_replica(probe, replica_url, running_at_least=args.max_num_seqs)
                t_settle = time.perf_counter()
                await asyncio.sleep(args.settle)
            t_start = time.perf_counter()
            meter = CpuMeter(pids)
            live = await interactive_load(gateway, args, seed)
            t_end = time.perf_counter()
            cpu = meter.read()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await bulk_client.aclose()
        await wait_replica(probe, replica_url, idle=True)
        post = metric_sum(await replica_metrics(probe, replica_url),
                          "argosy:num_preemptions_total")
    ok = [r for r in live if r.ok]
    ttfts, e2es = [r.ttft for r in ok], [r.e2e for r in ok]

    def ms(values: list[Any], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else 1000 * v

    row.update({
        "interactive_ok": len(ok), "interactive_total": len(live),
        "interactive_errors": sorted({r.error for r in live if r.error})[:5],
        "ttft_p50_ms": ms(ttfts, 50), "ttft_p90_ms": ms(ttfts, 90),
        "e2e_p50_ms": ms(e2es, 50), "e2e_p90_ms": ms(e2es, 90),
        "interactive_window_s": t_end - t_start,
        "load_avg_end": os.getloadavg()[0],
        "ours_cores": cpu["ours_cores"], "other_cores": cpu["other_cores"],
    })
    if phase != "alone":
        row.update({
            "bulk_alone_tok_s": bulk.tok_s(t_settle, t_start),
            "bulk_tok_s": bulk.tok_s(t_start, t_end),
            "bulk_completed": bulk.completed,
            "bulk_errors": len(bulk.errors), "bulk_error_samples": bulk.errors[:3],
            "preemptions": None if pre is None or post is None else post - pre,
        })
    return row


# ------------------------------------------------------------------ report
COLUMNS = (("phase", "phase", "{}"), ("round", "round", "{}"), ("ok", "interactive_ok", "{}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
           ("e2e p50 ms", "e2e_p50_ms", "{:.0f}"), ("e2e p90 ms", "e2e_p90_ms", "{:.0f}"),
           ("bulk tok/s (alone)", "bulk_alone_tok_s", "{:.1f}"),
           ("bulk tok/s (w/ interactive)", "bulk_tok_s", "{:.1f}"),
           ("preemptions", "preemptions", "{:.0f}"),
           ("other procs' cores", "other_cores", "{:.2f}"),
           ("load avg", "load_avg_start", "{:.2f}"))


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        v = row.get(key)
        if key == "interactive_ok":
            return f"{v}/{row['interactive_total']}"
        return "" if v is None else fmt.format(v)

    lines = ["| " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """A / B for the latencies and B / A for bulk throughput, per round, then the median
    over rounds."""
    out: dict[str, list[float]] = {}
    for rnd in sorted({r["round"] for r in rows}):
        by = {r["phase"]: r for r in rows if r["round"] == rnd}
        a, b = by.get("A-no-prio"), by.get("B-prio")
        if not a or not b:
            continue
        for name, num, den in (("ttft_p50_A_over_B", a["ttft_p50_ms"], b["ttft_p50_ms"]),
                               ("ttft_p90_A_over_B", a["ttft_p90_ms"], b["ttft_p90_ms"]),
                               ("e2e_p50_A_over_B", a["e2e_p50_ms"], b["e2e_p50_ms"]),
                               ("bulk_tok_s_B_over_A", b["bulk_tok_s"], a["bulk_tok_s"])):
            if num is not None and den:
                out.setdefault(name, []).append(num / den)
    return {k: percentile(v, 50) for k, v in out.items()}


# ------------------------------------------------------------------ main
def phase_plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(phase, round) in run order: alone once, then A and B alternating."""
    plan = [] if args.no_alone else [("alone", 0)]
    return plan + [(p, r) for r in range(args.rounds) for p in PHASES[1:]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="tenant_priority."))
    logs.mkdir(parents=True, exist_ok=True)
    replica_url = f"http://127.0.0.1:{args.replica_port}"
    gateway = f"http://127.0.0.1:{args.gateway_port}"
    argosy = [sys.executable, "-m", "argosy_runtime.cli.main"]
    started = utc_now()
    print(f"logs and configs in {logs}; load average {os.getloadavg()}", flush=True)
    serve = ["serve", "--model", args.model, "--dtype", args.dtype,
             "--port", str(args.replica_port), "--max-num-seqs", str(args.max_num_seqs)]
    if args.cpu_threads:
        serve += ["--cpu-threads", str(args.cpu_threads)]
    replica = start_process(argosy + serve, logs / "replica.log", replica_url + "/ready")
    rows: list[dict[str, Any]] = []
    try:
        # warm up the replica (first steps of a fresh process are slower)
        httpx.post(replica_url + "/v1/completions", timeout=120, json={
            "model": args.model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        for phase, rnd in phase_plan(args):
            priority = args.bulk_priority if phase == "B-prio" else None
            cfg = write_gateway_config(logs / f"gateway-{phase}.yaml", args, replica_url,
                                       priority)
            gw = start_process(argosy + ["gateway", "--config", str(cfg)],
                               logs / f"gateway-{phase}-{rnd}.log", gateway + "/ready",
                               timeout=60)
            try:
                row = asyncio.run(run_phase(phase, gateway, replica_url, args, rnd,
                                            [replica.pid, gw.pid, os.getpid()]))
            finally:
                stop_process(gw)
            row["bulk_priority"] = priority
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        stop_process(replica)
    print()
    print(format_table(rows))
    r = ratios(rows)
    if r:
        print(", ".join(f"{k} = {v:.2f}" for k, v in r.items() if v is not None))
    if args.json:
        write_results(args.json, "bench/tenant_priority.py",
                      sys.argv[1:] if argv is None else argv, started, args,
                      rows=rows, ratios=r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
