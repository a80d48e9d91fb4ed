"""How long a batch stalls when its replica is told to stop and another one sharing the
`--batch-dir` takes it over (docs/batch.md, "Replicas sharing one folder").

Two `argosy serve` processes on one batch folder. A batch of BULK completions is created on
replica A; once DONE_BEFORE of them are answered, A gets SIGTERM (it drains: running requests
finish, no new ones start) and replica B, which scans every 5 s, takes the batch over. Prints
the drain time (SIGTERM -> A exited), the gap (A exited -> B's first answer), the whole
batch's wall time, and checks that every request was answered exactly once.

    python bench/batch_takeover.py --json docs/benchmarks/batch/takeover.json
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from batch_priority import start_server, stop_server


def serve_cmd(args: argparse.Namespace, port: int, batch_dir: Path) -> list[str]:
    return [sys.executable, "-m", "argosy_runtime.cli.main", "serve", "--model", args.model,
            "--port", str(port), "--batch-dir", str(batch_dir), "--max-num-seqs",
            str(args.max_num_seqs), "--drain-timeout", "30"]


def counts(client: httpx.Client, batch_id: str) -> tuple[str, int]:
    batch = client.get(f"/v1/batches/{batch_id}").json()
    c = batch["request_counts"]
    return batch["status"], c["completed"] + c["failed"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bulk", type=int, default=48, help="requests in the batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--done-before", type=int, default=8,
                        help="answers recorded before replica A gets SIGTERM")
    parser.add_argument("--ports", default="8731,8732")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    port_a, port_b = (int(p) for p in args.ports.split(","))
    work = Path(tempfile.mkdtemp(prefix="argosy-takeover-"))
    batch_dir = work / "batches"
    a = start_server(serve_cmd(args, port_a, batch_dir), port_a, work / "a.log")
    b = start_server(serve_cmd(args, port_b, batch_dir), port_b, work / "b.log")
    try:
        lines = "".join(json.dumps({
            "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": args.model, "prompt": f"Item {i}:", "max_tokens": args.max_tokens,
                     "ignore_eos": True}}) + "\n" for i in range(args.bulk))
        client_a = httpx.Client(base_url=f"http://127.0.0.1:{port_a}", timeout=60)
        client_b = httpx.Client(base_url=f"http://127.0.0.1:{port_b}", timeout=60)
        upload = client_a.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("bulk.jsonl", io.BytesIO(lines.encode()))})
        t0 = time.perf_counter()
        batch_id = client_a.post("/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}).json()["id"]
        while counts(client_a, batch_id)[1] < args.done_before:
            time.sleep(0.1)
        sigterm = time.perf_counter()
        stop_server(a)  # SIGTERM, then waits for the exit
        exited = time.perf_counter()
        _, after_drain = counts(client_b, batch_id)
        while (state := counts(client_b, batch_id))[1] == after_drain:
            time.sleep(0.1)
        resumed = time.perf_counter()
        while state[0] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.2)
            state = counts(client_b, batch_id)
        done = time.perf_counter()
        batch = client_b.get(f"/v1/batches/{batch_id}").json()
        output = client_b.get(f"/v1/files/{batch['output_file_id']}/content").text
        ids = sorted(json.loads(x)["custom_id"] for x in output.splitlines())
    finally:
        if a.poll() is None:
            stop_server(a)
        stop_server(b)
    result = {
        "bulk": args.bulk, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
        "status": batch["status"], "answered_before_sigterm": args.done_before,
        "answered_by_a": after_drain,
        "drain_s": round(exited - sigterm, 2), "gap_s": round(resumed - exited, 2),
        "wall_s": round(done - t0, 2),
        "each_answered_once": ids == sorted(f"r{i}" for i in range(args.bulk)),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["each_answered_once"] and batch["status"] == "completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
