"""Continuous batching under concurrent streams, and aborting on client disconnect."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from argosy_runtime import SamplingParams
from openai import AsyncOpenAI
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

NUM_STREAMS = 64
MAX_TOKENS = 6
PROMPTS = [f"Fact number {i} about {topic}:" for i, topic in enumerate(
    ["the sea", "mountains", "bread", "music", "trains", "winter", "cats", "stars"] * 8)]


async def test_64_concurrent_streams_equal_offline_greedy(server: ServerProcess,
                                                          offline_llm) -> None:
    assert len(PROMPTS) == NUM_STREAMS
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)

    async def one(prompt: str) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                 max_tokens=MAX_TOKENS, temperature=0)
        parts, finish, chunks = [], None, 0
        async for chunk in stream:
            chunks += 1
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish, chunks

    peak_running = 0

    async def watch() -> None:
        nonlocal peak_running
        async with httpx.AsyncClient() as h:
            while True:
                text = (await h.get(server.url + "/metrics")).text
                for line in text.splitlines():
                    if line.startswith("argosy:num_requests_running"):
                        peak_running = max(peak_running, int(float(line.split()[-1])))
                await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(one(p) for p in PROMPTS))
    finally:
        watcher.cancel()
        await client.close()
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0,
                                                            max_tokens=MAX_TOKENS))
    for (text, finish, chunks), exp in zip(results, expected, strict=True):
        assert text == exp.outputs[0].text
        assert finish == exp.outputs[0].finish_reason
        assert chunks >= 2
    # the requests really ran as one batch, not one after another
    assert peak_running >= NUM_STREAMS // 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_kv(server: ServerProcess, path: str) -> None:
    idle_running, idle_kv = server.running_and_kv()
    assert idle_running == 0
    body = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    body.update({"prompt": "Tell me a long story."} if "chat" not in path else
                {"messages": [{"role": "user", "content": "Tell me a long story."}]})
    with httpx.Client(base_url=server.url, timeout=60) as h:
        with h.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            data = 0
            while data < 4:
                data += next(lines).startswith("data: ")
            running, kv = server.running_and_kv()
            assert running == 1 and kv > idle_kv
        # leaving both blocks closes the connection mid-stream
    server.assert_back_to_idle(idle_kv, within=1.0)
    assert "client_disconnected" in server.log_text()


def test_disconnect_while_waiting_for_a_non_streamed_answer(server: ServerProcess) -> None:
    idle_running, idle_kv = server.running_and_kv()
    body = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 1500,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    server.assert_back_to_idle(idle_kv, within=2.0)


def test_a_stream_keeps_flowing_while_a_big_prompt_is_tokenized(server: ServerProcess) -> None:
    """A long text is tokenized in a worker thread, and the tokenizer releases the GIL there:
    the event loop keeps serving other clients (it used to stop for the whole tokenization,
    ~25 s for 10 MB). Measured as the latency of /health polls and the chunks of a stream
    arriving while /tokenize counts ~2 MB of distinct words."""
    text = " ".join(f"w{i}x{i % 97}" for i in range(200_000))
    health: list[float] = []
    chunks = 0
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as h:
            while not done.is_set():
                sent = time.monotonic()
                h.get("/health")
                health.append(time.monotonic() - sent)
                time.sleep(0.02)

    def stream() -> None:
        nonlocal chunks
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if done.is_set():
                    return

    threads = [threading.Thread(target=poll_health), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    while chunks < 2:
        time.sleep(0.01)
    start, chunks_before = time.monotonic(), chunks
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
    took, chunks_during = time.monotonic() - start, chunks - chunks_before
    done.set()
    for t in threads:
        t.join()
    assert r.status_code == 200 and r.json()["count"] > 200_000, r.text
    assert max(health) < took / 2, (max(health), took)
    assert chunks_during >= 2, (chunks_during, took)
