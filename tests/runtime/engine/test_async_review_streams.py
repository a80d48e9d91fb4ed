"""AsyncEngine review: what a consumer sees when the server ends requests around the time
they finish, and that nothing leaks."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError
from engine_helpers import assert_no_leaks


@pytest.fixture
def engine(random_llama_dir) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                     max_model_len=256, kv_cache_memory=256 * 4 * 512)


async def _until(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_abort_all_keeps_the_answer_of_a_request_that_already_finished(
        engine: LLMEngine) -> None:
    """A drain that times out (abort_all) while a finished request's last output waits for
    its slow reader: the request is done, so its reader gets the answer, not "aborted, send
    it again" (which would make the client run it twice)."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        stream = await async_engine.add("done", [5, 6, 7], params)
        await _until(lambda: stream.finished)  # dispatched, not read yet
        async_engine.abort_all("the server is shutting down")
        outputs = [out async for out in stream]
        assert outputs[-1].finished
        assert len(outputs[-1].outputs[0].token_ids) == 3
        assert async_engine.num_active == 0
        assert_no_leaks(engine)
    finally:
        async_engine.shutdown()


async def test_abort_all_still_aborts_the_unfinished_beside_a_finished_one(
        engine: LLMEngine) -> None:
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        done = await async_engine.add(
            "done", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        long = await async_engine.add(
            "long", [5, 6, 8], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        await _until(lambda: done.finished)
        async_engine.abort_all("the server is shutting down")
        with pytest.raises(RequestAbortedError):
            async for _ in long:
                pass
        assert [out.finished async for out in done][-1]
        await _until(lambda: not engine.has_unfinished_requests())
        assert async_engine.num_active == 0
    finally:
        async_engine.shutdown()


class _ProbedCounter(collections.Counter):
    """A Counter whose iteration pauses after its first item to run `hook` (set by the
    test): there the engine thread gets to apply the commands, as a thread switch in the
    middle of the event loop's unlocked read would let it."""

    hook: Callable[[], None] | None = None

    def items(self):  # noqa: ANN201
        it = iter(super().items())
        for item in it:
            yield item
            hook, self.hook = self.hook, None
            if hook is not None:
                hook()


async def test_counting_waiting_requests_while_the_engine_thread_applies_adds(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """`num_waiting` (every add's queue check, the metrics gauge) reads the count of adds
    not yet applied without the lock, while the engine thread applies them: it updated that
    Counter in place (`-=` drops the keys at zero), so the read could fail with "dictionary
    changed size during iteration" (an add answered 500)."""
    gate = threading.Event()
    add_request = engine.add_request

    def gated_add_request(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait(10)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", gated_add_request)
    async_engine = AsyncEngine(engine, max_waiting=100)
    async_engine.start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        adding = asyncio.create_task(async_engine.add("a", [5, 6, 7], params))
        while not async_engine._pending_adds:  # posted; the engine thread waits at the gate
            await asyncio.sleep(0.001)
        stats_before = async_engine._stats

        def let_the_engine_thread_apply() -> None:
            gate.set()
            deadline = time.monotonic() + 10
            while async_engine._stats is stats_before:  # replaced once the add is applied
                assert time.monotonic() < deadline
                time.sleep(0.001)

        probed = _ProbedCounter(async_engine._pending_adds)
        probed.hook = let_the_engine_thread_apply
        async_engine._pending_adds = probed
        assert async_engine.num_waiting == 1  # read as it was when the read began
        stream = await adding
        assert [out.finished async for out in stream][-1]
        assert async_engine.num_waiting == 0
    finally:
        gate.set()
        async_engine.shutdown()


async def test_a_dead_engine_loop_keeps_the_answer_of_a_request_that_already_finished(
        engine: LLMEngine) -> None:
    """The loop dies (`_fail_all`) while a finished request's last output waits for its
    reader: that request is done and keeps its answer; an unfinished one fails."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        done = await async_engine.add(
            "done", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        await _until(lambda: done.finished)
        queued = await async_engine.add(
            "queued", [5, 6, 8], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))

        def broken() -> bool:
            raise RuntimeError("injected loop failure")

        async_engine._has_work = broken  # type: ignore[method-assign]
        with async_engine._cond:
            async_engine._cond.notify()
        await _until(lambda: async_engine.dead is not None)
        with pytest.raises(EngineDeadError):
            async for _ in queued:
                pass
        outputs = [out async for out in done]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
    finally:
        async_engine.shutdown()


async def test_a_request_with_n_sequences_on_free_seats_is_not_counted_as_waiting(
        random_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A request with n=4 runs as 4 sequences, each waiting in the engine until a step takes
    it; the free seats were set against 1 untried entry (one per request), so between its
    add and the end of the next step (a whole prefill) 3 of its sequences counted as
    waiting although 8 free seats take them all: the gauge read 3 and max_waiting=2
    refused every new request (429) meanwhile."""
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_model_len=256, kv_cache_memory=256 * 4 * 512, max_num_seqs=8)
    execute = engine.runner.execute
    gate = threading.Event()

    def gated(sched):  # noqa: ANN001, ANN202
        gate.wait(10)
        return execute(sched)

    monkeypatch.setattr(engine.runner, "execute", gated)
    async_engine = AsyncEngine(engine, max_waiting=2, max_num_seqs=8)
    async_engine.start()
    try:
        params = SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0, ignore_eos=True)
        first = await async_engine.add("four", [5, 6, 7], params)  # applied; its step waits
        assert async_engine.stats.num_requests_waiting == 4  # the engine counts sequences
        assert async_engine.num_waiting == 0  # all four take free seats at the next step
        adding = asyncio.create_task(async_engine.add(
            "one", [5, 6, 8], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        await asyncio.sleep(0.05)
        gate.set()
        second = await adding  # not refused: QueueFullError before
        for stream in (first, second):
            outputs = [out async for out in stream]
            assert outputs[-1].finished
        await _until(lambda: async_engine.num_waiting == 0)
    finally:
        gate.set()
        async_engine.shutdown()
