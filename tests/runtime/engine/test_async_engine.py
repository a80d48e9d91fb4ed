"""AsyncEngine: how a request's consumer learns that the server ended it (an abort of
everything on shutdown, a failed step), and that nothing leaks or stops serving after."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
)
from argosy_runtime.server.serving_common import with_deadline
from engine_helpers import assert_no_leaks, fail_the_nth_step

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(random_llama_dir) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                     max_model_len=256, kv_cache_memory=256 * 4 * 512)


async def _consume(stream) -> list:  # noqa: ANN001
    """Every output of a stream (an error ending it propagates)."""
    seen = []
    async for out in stream:
        seen.append(out)
    return seen


async def _idle(async_engine: AsyncEngine) -> None:
    """Wait until the worker thread has applied every abort (no request left)."""
    for _ in range(500):
        if not async_engine.engine.has_unfinished_requests() and not async_engine._commands:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine still holds requests")


async def test_abort_all_ends_every_waiting_consumer_with_a_reason(engine: LLMEngine) -> None:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        streams = [await async_engine.add(f"r{i}", [5, 6, 7, i + 1], LONG) for i in range(3)]
        consumers = [asyncio.create_task(_consume(s)) for s in streams]
        while async_engine.stats.num_requests_running < 3:  # all three are generating
            await asyncio.sleep(0.01)
        async_engine.abort_all("the server is shutting down")
        results = await asyncio.wait_for(
            asyncio.gather(*consumers, return_exceptions=True), timeout=10)
        for result in results:
            assert isinstance(result, RequestAbortedError), result
            assert "shutting down" in str(result)
        await _idle(async_engine)
        assert async_engine.num_active == 0
        assert_no_leaks(engine)
    finally:
        async_engine.shutdown()


async def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_the_nth_step(engine, monkeypatch, 3)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        stream = await async_engine.add("doomed", [5, 6, 7], LONG)
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(_consume(stream), timeout=30)
        assert async_engine.num_step_errors == 1
        assert_no_leaks(engine)
        await _assert_serves_a_new_request(async_engine)
    finally:
        async_engine.shutdown()


async def _assert_serves_a_new_request(async_engine: AsyncEngine) -> None:
    """The engine takes and finishes a new request (after a failed step)."""
    after = await async_engine.add("after", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    outputs = await asyncio.wait_for(_consume(after), timeout=30)
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4


@pytest.mark.parametrize(("failure", "code", "said"), [
    (RequestAbortedError("request aborted: the server is shutting down; send it again"),
     "engine_unavailable", "shutting down"),
    # a bug while the events are made (was: the connection cut, no event, no [DONE])
    (RuntimeError("a parser bug"), "internal_error", "server's log"),
])
async def test_a_stream_the_engine_ends_closes_with_an_error_event_and_done(
        failure: Exception, code: str, said: str) -> None:
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(request_timeout=None))

    async def chunks():  # noqa: ANN202
        yield "data: {}\n\n"
        raise failure

    sent = [c async for c in with_deadline(ctx, chunks(), on_timeout=lambda: "unused")]
    assert sent[0] == "data: {}\n\n" and sent[-1] == "data: [DONE]\n\n"
    error = json.loads(sent[1].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", code)
    assert said in error["message"]


async def test_a_failed_step_does_not_leave_a_full_queue_refusing_every_request(
        random_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The queue-depth gauges and the max_waiting check read the stats snapshot. A failed
    step aborts every request in flight: if the snapshot still showed the queue full, each
    new request got QueueFullError, none was posted, so no snapshot ever came to clear it."""
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_model_len=256, kv_cache_memory=256 * 4 * 512, max_num_seqs=1)
    execute = engine.runner.execute

    def fails_once_one_waits(sched):  # noqa: ANN001, ANN202
        if engine.scheduler.num_waiting and not fails_once_one_waits.failed:
            fails_once_one_waits.failed = True
            raise RuntimeError("injected step failure")
        return execute(sched)

    fails_once_one_waits.failed = False
    monkeypatch.setattr(engine.runner, "execute", fails_once_one_waits)
    async_engine = AsyncEngine(engine, max_waiting=1, max_num_seqs=1)
    async_engine.start()
    try:
        running = await async_engine.add("running", [5, 6, 7], LONG)
        waiting = await async_engine.add("waiting", [8, 9], LONG)
        for stream in (running, waiting):
            with pytest.raises(EngineDeadError, match="injected step failure"):
                await asyncio.wait_for(_consume(stream), timeout=30)
        await _idle(async_engine)
        assert async_engine.num_waiting == 0
        await _assert_serves_a_new_request(async_engine)
    finally:
        async_engine.shutdown()


async def test_requests_waiting_for_kv_blocks_count_as_waiting_beside_free_seats(
        random_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Free seats take a request that the scheduler has not tried yet at the next step, so
    it is not waiting; one the last step left waiting beside free seats (short of KV blocks:
    preempted, or a prompt the pool cannot take now) is. It was counted as about to run:
    the gauge read 0 and max_waiting never refused anything on a full KV cache."""
    # 64 blocks of 4 tokens: "big" (200 + 56 tokens) takes 50 at once and all 64 at the end;
    # "small" needs 15 for its prompt.
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_model_len=256, kv_cache_memory=64 * 4 * 512, max_num_seqs=4)
    execute = engine.runner.execute

    def slow(sched):  # noqa: ANN001, ANN202
        time.sleep(0.02)  # the test polls between steps
        return execute(sched)

    monkeypatch.setattr(engine.runner, "execute", slow)
    async_engine = AsyncEngine(engine, max_waiting=1, max_num_seqs=4)
    async_engine.start()
    params = SamplingParams(max_tokens=56, temperature=0, ignore_eos=True)
    try:
        big = await async_engine.add("big", list(range(3, 203)), params)
        small = await async_engine.add("small", list(range(300, 360)),
                                       SamplingParams(max_tokens=4, temperature=0))
        for _ in range(200):
            if async_engine.num_waiting == 1 or engine.get_stats().num_requests_waiting == 0:
                break
            await asyncio.sleep(0.005)
        assert async_engine.stats.num_requests_waiting == 1  # small: blocks short, seats free
        assert async_engine.num_waiting == 1
        with pytest.raises(QueueFullError):
            await async_engine.add("refused", [5, 6, 7], params)
        for stream in (big, small):
            outputs = await asyncio.wait_for(_consume(stream), timeout=60)
            assert outputs[-1].finished
    finally:
        async_engine.shutdown()
