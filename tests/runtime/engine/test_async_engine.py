"""AsyncEngine: how a request's consumer learns that the server ended it (an abort of
everything on shutdown, a failed step), and that nothing leaks or stops serving after."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from argosy_runtime.server.serving_common import with_deadline
from engine_helpers import assert_no_leaks

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
    execute = engine.runner.execute
    calls = 0

    def fails_on_the_third_call(sched):  # noqa: ANN001, ANN202
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected step failure")
        return execute(sched)

    monkeypatch.setattr(engine.runner, "execute", fails_on_the_third_call)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        stream = await async_engine.add("doomed", [5, 6, 7], LONG)
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await asyncio.wait_for(_consume(stream), timeout=30)
        assert async_engine.num_step_errors == 1
        assert_no_leaks(engine)
        after = await async_engine.add("after", [5, 6, 7],
                                       SamplingParams(max_tokens=4, temperature=0))
        outputs = await asyncio.wait_for(_consume(after), timeout=30)
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    finally:
        async_engine.shutdown()


async def test_a_stream_the_engine_ends_closes_with_an_error_event_and_done() -> None:
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(request_timeout=None))

    async def chunks():  # noqa: ANN202
        yield "data: {}\n\n"
        raise RequestAbortedError("request aborted: the server is shutting down; send it again")

    sent = [c async for c in with_deadline(ctx, chunks(), on_timeout=lambda: "unused")]
    assert sent[0] == "data: {}\n\n" and sent[-1] == "data: [DONE]\n\n"
    error = json.loads(sent[1].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert "shutting down" in error["message"]
