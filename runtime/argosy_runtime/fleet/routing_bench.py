"""Routing benchmark: round-robin vs prefix-affinity side by side on one pair of replicas.

    python -m argosy_runtime.fleet.routing_bench --replicas 2 --rate 2 --num-prompts 48

Starts the replicas once, puts two gateways in front of the same replicas (one per policy),
and alternates load runs between them (`--rounds` pairs, the order flipped every round, so
neither policy always runs on a warmer machine). The load is `--tenants` concurrent
`argosy bench serve --dataset shared-prefix` clients, each with its own seed and so its own
shared prefix (one system prompt per tenant); seeds are fresh for every run, so no run finds
its prefixes cached by an earlier one.
Each run's aggregate prefix-cache hit rate comes from the replicas' own counters
(`argosy:prefix_cache_hits_total / argosy:prefix_cache_queries_total`, difference over the run,
summed over replicas); TTFT comes from the load generator. Prints a Markdown table and JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from typing import Any

import aiohttp

from argosy_runtime.fleet.replica_process import ReplicaProcess, free_port
from argosy_runtime.gateway.config import (
    GatewayConfig,
    HealthConfig,
    ModelRouteConfig,
    RoutingConfig,
)
from argosy_runtime.gateway.health import parse_replica_metrics
from argosy_runtime.gateway.proxy.app import Gateway, start_gateway

POLICIES = ("round-robin", "prefix-affinity")


def parse_variant(spec: str) -> RoutingConfig:
    """`prefix-affinity` or `prefix-affinity@min_capacity=1,load_factor=1.1` -> RoutingConfig."""
    name, _, overrides = spec.partition("@")
    kwargs: dict[str, Any] = {"policy": name}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = float(value) if "." in value else int(value)
    return RoutingConfig(**kwargs)


async def prefix_counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """(queries, hits) summed over replicas."""
    queries = hits = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as resp:
            found = parse_replica_metrics(await resp.text())
        queries += found.get("prefix_cache_queries", 0.0)
        hits += found.get("prefix_cache_hits", 0.0)
    return queries, hits


async def builtin_load(base_url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A small shared-prefix load (used only with --load builtin, when `argosy bench serve` is
    not available): `--groups` long prefixes, prompts = prefix + a short question, Poisson
    arrivals at --rate, streamed; TTFT = time to the first text chunk."""
    import random

    rng = random.Random(seed)
    words = ["river", "signal", "copper", "lantern", "harvest", "orbit", "meadow", "cipher",
             "granite", "velvet", "thunder", "archive", "compass", "ember", "quartz", "tide"]
    prefixes = [
        f"Document {seed}-{g}. " + " ".join(rng.choice(words) for _ in range(args.prefix_words))
        for g in range(args.groups)
    ]
    ttfts: list[float] = []
    failures = 0

    async def one(session: aiohttp.ClientSession, prompt: str) -> None:
        nonlocal failures
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        try:
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                first = None
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic() - t0
                if resp.status != 200 or first is None:
                    failures += 1
                else:
                    ttfts.append(first)
        except aiohttp.ClientError:
            failures += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        for i in range(args.num_prompts):
            prompt = f"{rng.choice(prefixes)}\nQuestion {i}: what is {rng.choice(words)}?"
            tasks.append(asyncio.create_task(one(session, prompt)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    ttfts.sort()
    return {
        "command": f"builtin shared-prefix load, seed {seed}",
        "result": {"completed": len(ttfts), "failed": failures,
                   "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                   "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None},
    }  # fmt: skip


async def run_load(base_url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One load run: `--tenants` concurrent `argosy bench serve --dataset shared-prefix`
    clients, each with its own seed (so its own shared prefix: one tenant's system prompt),
    their results merged (TTFT percentiles over every request of every tenant)."""
    if args.load == "builtin":
        return await builtin_load(base_url, args, seed)
    import tempfile

    tmp = tempfile.mkdtemp(prefix="argosy-routing-bench-")
    cmds = []
    for tenant in range(args.tenants):
        cmds.append([
            sys.executable, "-m", "argosy_runtime.cli.main", "bench", "serve",
            "--base-url", base_url, "--model", args.model,
            "--rate", str(args.rate / args.tenants), "--num-prompts", str(args.num_prompts),
            "--dataset", "shared-prefix", "--seed", str(seed * 100 + tenant),
            "--json", f"{tmp}/tenant{tenant}.json", *args.bench_args,
        ])  # fmt: skip
    procs = [
        await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        for cmd in cmds
    ]
    outs = await asyncio.gather(*(p.communicate() for p in procs))
    ttfts: list[float] = []
    completed = failed = 0
    for cmd, proc, (out, _) in zip(cmds, procs, outs, strict=True):
        path = cmd[cmd.index("--json") + 1]
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            text = out.decode(errors="replace")[-3000:]
            raise RuntimeError(f"bench failed ({proc.returncode}): {' '.join(cmd)}\n{text}") from exc
        for rows in data["runs"].values():
            for row in rows:
                ttfts.extend(row["samples"]["ttft"])
                completed += row["completed"]
                failed += row["failed"]
    ttfts.sort()
    shown = " ".join(cmds[0][2:]).replace(f"--seed {seed * 100}", "--seed <tenant seed>")
    shown = shown.replace(f"{tmp}/tenant0.json", "<tenant>.json")
    return {
        "command": f"{args.tenants} concurrent x: argosy {shown.split(' ', 1)[1]}",
        "result": {
            "completed": completed,
            "failed": failed,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        },
    }


def parse_bench_output(text: str) -> dict[str, Any]:
    """The last JSON object the load generator printed (its result summary)."""
    for match in reversed(list(re.finditer(r"^\{.*\}\s*$", text, re.M | re.S))):
        try:
            return json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
    start = text.rfind("\n{")
    if start >= 0:
        return json.loads(text[start:])
    raise ValueError(f"no JSON result in the bench output:\n{text[-2000:]}")


def pick(result: dict[str, Any], *names: str) -> float | None:
    """First present metric among `names` (search nested dicts too)."""
    for name in names:
        if name in result and isinstance(result[name], int | float):
            return float(result[name])
    for value in result.values():
        if isinstance(value, dict):
            found = pick(value, *names)
            if found is not None:
                return found
    return None


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    replicas = [
        ReplicaProcess(args.model, args.model, free_port(), extra_args=args.serve_args,
                       log_dir=args.log_dir)
        for _ in range(args.replicas)
    ]  # fmt: skip
    await asyncio.gather(*(r.start() for r in replicas))
    runners = []
    try:
        ready = await asyncio.gather(*(r.wait_ready(600) for r in replicas))
        if not all(ready):
            raise RuntimeError("replicas not ready:\n" + "\n".join(r.log_tail() for r in replicas))
        urls = [r.url for r in replicas]
        gateways: dict[str, str] = {}
        for policy in args.policies:
            cfg = GatewayConfig(
                models=(ModelRouteConfig(name=args.model, backends=tuple(urls)),),
                routing=parse_variant(policy),
                health=HealthConfig(interval_s=1.0),
            )
            runner, port = await start_gateway(Gateway(cfg), "127.0.0.1", 0)
            runners.append(runner)
            gateways[policy] = f"http://127.0.0.1:{port}"
        runs: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as session:
            seed = args.seed
            for rnd in range(args.rounds):
                order = args.policies if rnd % 2 == 0 else args.policies[::-1]
                for policy in order:
                    seed += 1
                    q0, h0 = await prefix_counters(session, urls)
                    t0 = time.monotonic()
                    load = await run_load(gateways[policy], args, seed)
                    q1, h1 = await prefix_counters(session, urls)
                    res = load["result"]
                    runs.append({
                        "round": rnd, "policy": policy, "seed": seed,
                        "wall_s": round(time.monotonic() - t0, 1),
                        "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None,
                        "ttft_p50_s": pick(res, "ttft_p50_s", "p50_ttft_s", "median_ttft_s",
                                           "ttft_p50", "p50_ttft"),
                        "ttft_p90_s": pick(res, "ttft_p90_s", "p90_ttft_s"),
                        "completed": pick(res, "completed"),
                        "failed": pick(res, "failed"),
                        "command": load["command"],
                        "bench": res,
                    })  # fmt: skip
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "bench"}),
                          flush=True)
        return {"runs": runs, "summary": summarize(runs, args.policies)}
    finally:
        for runner in runners:
            await runner.cleanup()
        await asyncio.gather(*(r.drain(30) for r in replicas), return_exceptions=True)


def summarize(runs: list[dict[str, Any]], policies: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in policies or POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        hit = [r["prefix_cache_hit_rate"] for r in mine if r["prefix_cache_hit_rate"] is not None]
        ttft = [r["ttft_p50_s"] for r in mine if r["ttft_p50_s"] is not None]
        p90 = [r["ttft_p90_s"] for r in mine if r.get("ttft_p90_s") is not None]
        out[policy] = {
            "prefix_cache_hit_rate_mean": statistics.fmean(hit) if hit else None,
            "ttft_p50_s_median": statistics.median(ttft) if ttft else None,
            "ttft_p90_s_median": statistics.median(p90) if p90 else None,
        }
    rr, pa = out.get("round-robin", {}), out.get("prefix-affinity", {})
    if rr.get("ttft_p50_s_median") and pa.get("ttft_p50_s_median"):
        out["ttft_p50_ratio_pa_over_rr"] = pa["ttft_p50_s_median"] / rr["ttft_p50_s_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2.0, help="Total requests/s.")
    parser.add_argument("--num-prompts", type=int, default=8, help="Per tenant.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--policies", type=lambda v: v.split(";"), default=list(POLICIES),
                        help="';'-separated gateway variants, e.g. "
                             "'round-robin;prefix-affinity;prefix-affinity@min_capacity=1'.")
    parser.add_argument("--load", choices=["bench", "builtin"], default="bench",
                        help="Load generator: argosy bench serve (default) or a built-in one.")
    parser.add_argument("--tenants", type=int, default=8,
                        help="Concurrent bench clients, each with its own shared prefix.")
    parser.add_argument("--groups", type=int, default=16, help="builtin: prefix groups.")
    parser.add_argument("--prefix-words", type=int, default=300, help="builtin: prefix length.")
    parser.add_argument("--max-tokens", type=int, default=16, help="builtin: tokens per answer.")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                        help="Argument for argosy serve (repeatable).")
    parser.add_argument("--bench-arg", dest="bench_args", action="append", default=[],
                        help="Argument for argosy bench serve (repeatable).")
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
