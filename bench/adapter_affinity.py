"""What the gateway's adapter affinity saves: adapter loads (and the latency they add) on
replicas that keep fewer LoRA adapters in memory than they serve.

Starts --replicas real `argosy serve` replicas, each with --max-loaded-loras C and the same
K (--adapters) small PEFT adapters (written here, random weights on the model's shapes), and
an `argosy gateway` in front of them. A seeded random mix of streamed completions, each
naming one of the K adapters uniformly, is sent through the gateway by --concurrency
closed-loop workers, first with `routing.adapter_affinity: true` (the default), then with
`false` (the policy alone), alternating for --rounds rounds; each round sends the same mix to
both. The replicas stay up across arms (only the gateway restarts), so each arm starts from
what the previous one left loaded.

Reported per arm: adapter loads per replica (the change of each replica's
`argosy:lora_adapter_loads_total`; every load at the cap evicts another adapter), how many
replicas each adapter's requests went to (the gateway's `x-argosy-backend`) and how many
adapters each replica served most of, TTFT p50/p90 and the wall time of the mix. Loads are the robust number; latencies move with the machine.

    python bench/adapter_affinity.py --json docs/benchmarks/lora/adapter_affinity.json
    python bench/adapter_affinity.py --replicas 2 --max-loaded-loras 1 --adapters 4

Nothing here needs a GPU (docs/benchmarks/lora.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import yaml
from argosy_runtime.benchmarks.processes import start_process, stop_process
from argosy_runtime.benchmarks.prometheus_text import metric_sum
from argosy_runtime.benchmarks.results import utc_now, write_results
from argosy_runtime.benchmarks.serve import (
    RequestResult,
    make_requests,
    percentile,
    send_one,
)

ARMS = ("affinity-on", "affinity-off")
LOADS = "argosy:lora_adapter_loads_total"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-loaded-loras", type=int, default=1,
                   help="adapters each replica keeps in memory (default 1)")
    p.add_argument("--adapters", type=int, default=4, help="adapters served (default 4)")
    p.add_argument("--rank", type=int, default=8, help="the adapters' LoRA rank")
    p.add_argument("--requests", type=int, default=96, help="requests per arm and round")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input", type=int, default=32, help="words per prompt")
    p.add_argument("--output", type=int, default=16, help="tokens per answer (ignore_eos)")
    p.add_argument("--policy", default="prefix-affinity", help="the gateway's routing policy")
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs, alternating")
    p.add_argument("--cpu-threads", type=int, default=1, help="each replica's --cpu-threads")
    p.add_argument("--port", type=int, default=8150,
                   help="the gateway's port; replicas take the next ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="folder for adapters, configs and logs")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("replicas", "max_loaded_loras", "adapters", "rank", "requests",
                 "concurrency", "input", "output", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def adapter_names(k: int) -> list[str]:
    return [f"adapter-{i}" for i in range(k)]


def write_adapters(folder: Path, model: str, names: list[str], rank: int, seed: int) -> None:
    """PEFT folders (adapter_config.json + adapter_model.safetensors) with random q/v_proj
    LoRA weights on `model`'s shapes: what a load reads is real, the outputs do not matter."""
    import torch
    from argosy_runtime.model_loader import load_checkpoint
    from safetensors.torch import save_file

    spec = load_checkpoint(model).spec  # the spec only; weights stay on disk
    outs = {"q_proj": spec.num_attention_heads * spec.head_dim,
            "v_proj": spec.num_key_value_heads * spec.head_dim}
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        tensors = {}
        for layer in range(spec.num_hidden_layers):
            for module, out in outs.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{key}.lora_A.weight"] = 0.02 * torch.randn(
                    rank, spec.hidden_size, generator=generator)
                tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(
                    out, rank, generator=generator)
        path = folder / name
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": sorted(outs), "task_type": "CAUSAL_LM"}))


def adapter_homes(names: list[str], replica_urls: list[str]) -> dict[str, int]:
    """How many adapters each replica is first for in the gateway's rendezvous order: where
    affinity sent an adapter no replica had loaded before it counted the adapters each replica
    holds (hashing splits few adapters unevenly); now only its last tie-break."""
    from argosy_runtime.gateway.policies.hashing import rendezvous_order

    homes = Counter(rendezvous_order(n, replica_urls)[0] for n in names)
    return {url: homes[url] for url in replica_urls}


def gateway_config(args: argparse.Namespace, replica_urls: list[str],
                   affinity: bool) -> dict[str, Any]:
    """The gateway's YAML config (docs/gateway.md) for one arm."""
    return {
        "host": "127.0.0.1", "port": args.port,
        "routing": {"policy": args.policy, "adapter_affinity": affinity},
        "models": [{"name": args.model, "backends": replica_urls}],
    }


def loads(urls: list[str]) -> list[float]:
    return [metric_sum(httpx.get(u + "/metrics", timeout=10).text, LOADS) or 0.0 for u in urls]


def wait_for_adapters(gateway: str, names: list[str], timeout: float = 60) -> None:
    """Until the gateway lists every adapter (its replicas are up and serve them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = {m["id"] for m in httpx.get(gateway + "/v1/models", timeout=10).json()["data"]}
        if listed >= set(names):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway does not list {sorted(set(names) - listed)}")


def request_mix(args: argparse.Namespace, round_: int) -> list[dict[str, Any]]:
    """The round's requests: a uniform random adapter each, the same for both arms."""
    rng = random.Random(args.seed * 1000 + round_)
    names = adapter_names(args.adapters)
    specs = make_requests("synthetic", args.requests, args.input, args.output,
                          args.seed * 1000 + round_)
    return [{"model": rng.choice(names), "prompt": s.prompt, "max_tokens": s.output_len,
             "temperature": 0, "ignore_eos": True, "stream": True} for s in specs]


async def send_mix(gateway: str, bodies: list[dict[str, Any]], concurrency: int
                   ) -> tuple[list[RequestResult], dict[str, Counter[str]], float]:
    """Send `bodies` with `concurrency` closed-loop workers: results, which replicas served
    each adapter, and the wall time."""
    backends: dict[str, Counter[str]] = defaultdict(Counter)
    results: list[RequestResult] = []
    queue = list(enumerate(bodies))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            _, body = queue.pop(0)
            results.append(await send_one(client, gateway + "/v1/completions", body,
                                          chat=False))

    async def record(response: httpx.Response) -> None:
        model = json.loads(response.request.content).get("model")
        backends[model][response.headers.get("x-argosy-backend", "?")] += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, event_hooks={"response": [record]}) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, backends, time.perf_counter() - t0


def run_arm(arm: str, round_: int, args: argparse.Namespace, replica_urls: list[str],
            argosy: list[str], logs: Path) -> dict[str, Any]:
    config = logs / f"gateway-{arm}.yaml"
    config.write_text(yaml.safe_dump(gateway_config(args, replica_urls, arm == ARMS[0]),
                                     sort_keys=False))
    gateway = f"http://127.0.0.1:{args.port}"
    gw = start_process(argosy + ["gateway", "--config", str(config)],
                       logs / f"gateway-{arm}-{round_}.log", gateway + "/ready", timeout=60)
    try:
        wait_for_adapters(gateway, adapter_names(args.adapters))
        before = loads(replica_urls)
        results, backends, wall = asyncio.run(send_mix(gateway, request_mix(args, round_),
                                                       args.concurrency))
        after = loads(replica_urls)
    finally:
        stop_process(gw)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    per_replica = [a - b for a, b in zip(after, before, strict=True)]
    # The replica that served most of each adapter's requests: the split affinity made.
    mostly_on = Counter(c.most_common(1)[0][0] for c in backends.values())

    def ms(q: float) -> float | None:
        v = percentile(ttfts, q)
        return None if v is None else 1000 * v

    return {
        "arm": arm, "round": round_, "ok": len(ok), "total": len(results),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "loads_per_replica": per_replica, "loads": sum(per_replica),
        "replicas_per_adapter": {a: len(c) for a, c in sorted(backends.items())},
        "requests_per_replica": dict(sum(backends.values(), Counter())),
        "adapters_mostly_on": {u: mostly_on[u] for u in replica_urls},
        "ttft_p50_ms": ms(50), "ttft_p90_ms": ms(90), "wall_s": wall,
        "load_avg": os.getloadavg()[0],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| arm | round | ok | loads (per replica) | replicas per adapter | "
             "TTFT p50 ms | TTFT p90 ms | wall s | load avg |", "|" + "---|" * 9]
    for r in rows:
        spread = Counter(r["replicas_per_adapter"].values())
        spread_text = ", ".join(f"{n} adapters on {k}" for k, n in sorted(spread.items()))
        per = " + ".join(f"{v:.0f}" for v in r["loads_per_replica"])
        lines.append(f"| {r['arm']} | {r['round']} | {r['ok']}/{r['total']} | "
                     f"{r['loads']:.0f} ({per}) | {spread_text} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p90_ms']:.0f} | {r['wall_s']:.1f} | {r['load_avg']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="adapter_affinity."))
    logs.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    names = adapter_names(args.adapters)
    write_adapters(logs / "adapters", args.model, names, args.rank, args.seed)
    modules = ",".join(f"{n}={logs / 'adapters' / n}" for n in names)
    argosy = [sys.executable, "-m", "argosy_runtime.cli.main"]
    ports = [args.port + 1 + i for i in range(args.replicas)]
    replica_urls = [f"http://127.0.0.1:{p}" for p in ports]
    print(f"logs, adapters and configs in {logs}; load average {os.getloadavg()}", flush=True)
    homes = adapter_homes(names, replica_urls)
    print(f"adapters per replica by rendezvous hashing alone (the tie-break): {homes}")
    replicas = []
    rows: list[dict[str, Any]] = []
    try:
        for port, url in zip(ports, replica_urls, strict=True):
            cmd = ["serve", "--model", args.model, "--port", str(port),
                   "--max-loaded-loras", str(args.max_loaded_loras), "--lora-modules", modules]
            if args.cpu_threads:
                cmd += ["--cpu-threads", str(args.cpu_threads)]
            replicas.append(start_process(argosy + cmd, logs / f"replica-{port}.log",
                                          url + "/ready"))
        for url in replica_urls:  # the first steps of a fresh process are slower
            httpx.post(url + "/v1/completions", timeout=120, json={
                "model": args.model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        for round_ in range(args.rounds):
            for arm in ARMS:
                row = run_arm(arm, round_, args, replica_urls, argosy, logs)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for proc in replicas:
            stop_process(proc)
    print()
    print(format_table(rows))
    if args.json:
        write_results(args.json, "bench/adapter_affinity.py",
                      sys.argv[1:] if argv is None else argv, started, args,
                      adapter_homes=homes, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
