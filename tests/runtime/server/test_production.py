"""Production behaviour on a second server: bearer auth (from ARGOSY_API_KEY), the bounded
waiting queue (429 + Retry-After), the per-request timeout, and graceful drain on SIGTERM.

The drain test stops the server, so it runs last in this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from argosy_runtime.server.config import ServerConfig
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS = 8
MAX_WAITING = 2
REQUEST_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def prod() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING),
                         "--request-timeout", str(REQUEST_TIMEOUT_S), "--drain-timeout", "120",
                         env={"ARGOSY_API_KEY": KEY})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _gauges(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return m["argosy:num_requests_running"], m["argosy:num_requests_waiting"]


async def _until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


def test_api_key_from_flag_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARGOSY_API_KEY", "from-env")
    assert ServerConfig.api_key_from_env(None) == "from-env"
    assert ServerConfig.api_key_from_env("from-flag") == "from-flag"
    monkeypatch.setenv("ARGOSY_API_KEY", "")
    assert ServerConfig.api_key_from_env(None) is None


def test_bearer_auth_guards_v1_only(prod: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=prod.url, timeout=60) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = h.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        assert h.get("/v1/models").status_code == 401
        assert h.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert h.get(path).status_code == 200, path


async def test_full_waiting_queue_answers_429_with_retry_after(prod: ServerProcess) -> None:
    long = {"model": MODEL, "prompt": "Tell a story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=prod.url, headers=AUTH, timeout=120) as h, \
            contextlib.AsyncExitStack() as stack:
        for _ in range(MAX_NUM_SEQS):
            r = await stack.enter_async_context(h.stream("POST", "/v1/completions", json=long))
            assert r.status_code == 200
        await _until(lambda: _gauges(prod)[0] == MAX_NUM_SEQS)
        for _ in range(MAX_WAITING):  # the batch is full: these wait
            r = await stack.enter_async_context(h.stream("POST", "/v1/completions", json=long))
            assert r.status_code == 200
        await _until(lambda: _gauges(prod) == (MAX_NUM_SEQS, MAX_WAITING))
        r = await h.post("/v1/completions", json={**long, "stream": False})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        r = await h.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 429
    # closing the streams aborted all ten; the server takes new work again
    await _until(lambda: _gauges(prod) == (0, 0), timeout=10)
    async with httpx.AsyncClient(base_url=prod.url, headers=AUTH, timeout=120) as h:
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200


async def test_a_queue_full_of_less_urgent_requests_never_refuses_a_more_urgent_one(
        prod: ServerProcess) -> None:
    # Every seat and the whole waiting queue taken by priority-1 requests (bulk work, batch
    # requests): another priority-1 request is refused, a priority-0 one is served at once.
    bulk = {"model": MODEL, "prompt": "Tell a story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "priority": 1}
    async with httpx.AsyncClient(base_url=prod.url, headers=AUTH, timeout=120) as h, \
            contextlib.AsyncExitStack() as stack:
        for _ in range(MAX_NUM_SEQS + MAX_WAITING):
            r = await stack.enter_async_context(h.stream("POST", "/v1/completions", json=bulk))
            assert r.status_code == 200
        await _until(lambda: _gauges(prod) == (MAX_NUM_SEQS, MAX_WAITING))
        r = await h.post("/v1/completions", json={**bulk, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                  "priority": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    await _until(lambda: _gauges(prod) == (0, 0), timeout=10)


def test_a_beam_search_wider_than_the_server_admits_is_a_400(prod: ServerProcess) -> None:
    """Each beam is scored as its own request every step: 2 prompts x width 6 = 12 beams is
    more than 8 seats + 2 waiting, which used to get a 429 "retry later" from the second step
    on (after the first step's work), on an idle server, whatever the client retried."""
    body = {"model": MODEL, "prompt": ["Once upon a time", "Hi"], "max_tokens": 3, "n": 6,
            "use_beam_search": True}
    with httpx.Client(base_url=prod.url, headers=AUTH, timeout=120) as h:
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "at most 10" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "n": 6, "use_beam_search": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text
        r = h.post("/v1/completions", json={**body, "n": 5})  # 10 beams fit
        assert r.status_code == 200 and len(r.json()["choices"]) == 10, r.text


async def test_request_timeout_aborts_plain_and_streamed(prod: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 1800, "ignore_eos": True}
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=prod.url, headers=AUTH, timeout=120) as h:

        async def streamed() -> list[str]:
            async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        plain, lines = await asyncio.gather(h.post("/v1/completions", json=body), streamed())
    took = time.monotonic() - start
    assert plain.status_code == 408 and plain.json()["error"]["code"] == "request_timeout"
    # the stream got tokens, then an error event, then [DONE]
    assert len(lines) > 3 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    assert REQUEST_TIMEOUT_S - 1 <= took < REQUEST_TIMEOUT_S + 10
    await _until(lambda: _gauges(prod) == (0, 0), timeout=5)


async def test_sigterm_drains_running_streams_then_exits_0(prod: ServerProcess) -> None:
    num_streams, max_tokens = 8, 6
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = asyncio.Event()
    first_chunks = 0

    async def stream(h: httpx.AsyncClient, i: int) -> tuple[str, int, bool]:
        nonlocal first_chunks
        text, usage, done, seen = "", 0, False, False
        async with h.stream("POST", "/v1/completions",
                            json={**body, "prompt": f"Story {i}:"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    if not seen:
                        seen = True
                        first_chunks += 1
                        if first_chunks == num_streams:
                            started.set()
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        return text, usage, done

    async with httpx.AsyncClient(base_url=prod.url, headers=AUTH, timeout=300) as h:
        tasks = [asyncio.create_task(stream(h, i)) for i in range(num_streams)]
        await asyncio.wait_for(started.wait(), timeout=240)
        running, _ = _gauges(prod)
        assert running == num_streams  # all eight are mid-stream
        prod.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=prod.url, timeout=30) as probe:
            deadline = time.monotonic() + 10
            while (await probe.get("/ready")).status_code != 503:
                assert time.monotonic() < deadline, "/ready did not turn 503"
                await asyncio.sleep(0.05)
            assert (await probe.get("/health")).status_code == 200  # still alive
            r = await probe.post("/v1/completions", headers=AUTH,
                                 json={"model": MODEL, "prompt": "late", "max_tokens": 1})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "server_draining"
        results = await asyncio.gather(*tasks)
    for text, usage, done in results:
        assert done and usage == max_tokens and text
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, prod.proc.wait, 60) == 0
    assert "drained in" in prod.log_text()


def test_a_drain_that_times_out_tells_every_client_why() -> None:
    """SIGTERM with requests still running past --drain-timeout: each is aborted and its
    client is told so (a stream ends with an error event and [DONE], a plain request gets
    503 engine_unavailable) instead of waiting on a silent connection until uvicorn gives up;
    the server exits 0."""
    server = ServerProcess("--drain-timeout", "1").wait_ready()
    long = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as h, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(h.post, "/v1/completions", json={**long, "prompt": "Plain:"})
            with h.stream("POST", "/v1/chat/completions", json={
                    **long, "stream": True,
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                assert json.loads(next(lines)[6:])["choices"]  # under way
                server.proc.send_signal(signal.SIGTERM)
                rest = list(lines)
            answer = plain.result()
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert "shutting down" in error["message"]
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "engine_unavailable"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    log = server.log_text()
    assert "drain timeout: aborting 2 request(s)" in log
    assert "Traceback" not in log
