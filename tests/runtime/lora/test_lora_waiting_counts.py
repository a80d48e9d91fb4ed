"""Requests waiting for their LoRA adapter (`max_loaded_loras`: its first load in progress, or
every loaded slot held by other requests) are waiting requests: they count in
`argosy:num_requests_waiting` and against `max_waiting`, and a client that goes away, or an
abort of everything, frees their place and leaves no adapter held.

The engine's forward pass and the adapter loader are gated with events, so a request is held
exactly where the test needs it: a real request holds the only slot for as long as the test
keeps its step from finishing."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from pathlib import Path

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import AsyncEngine, QueueFullError, RequestAbortedError
from argosy_runtime.server.metrics import ServerMetrics

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks  # noqa: E402
from test_lora_engine import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    adapters,  # noqa: F401  (fixtures)
    model_dir,  # noqa: F401
)

PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
MAX_NUM_SEQS = 8  # the batch has free slots throughout: they must not hide adapter waiters


def lazy_engine(model: Path, folders: dict[str, Path]) -> LLMEngine:
    """One loaded adapter at most (max_loaded_loras=1), two registered."""
    return LLMEngine(model=str(model), dtype="float32", max_loaded_loras=1,
                     max_num_seqs=MAX_NUM_SEQS,
                     lora_modules={k: str(v) for k, v in folders.items()})


def gate(monkeypatch: pytest.MonkeyPatch, owner: object, attr: str) -> threading.Event:
    """Make `owner.attr(...)` wait for the returned event (set: passes straight through)."""
    event = threading.Event()
    inner = getattr(owner, attr)

    def gated(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        event.wait(60)
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, attr, gated)
    return event


def exported_waiting(metrics: ServerMetrics) -> float:
    """`argosy:num_requests_waiting` as a Prometheus scrape reads it."""
    text = metrics.render().decode()
    return float(re.search(r"^argosy:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M).group(1))


async def until(condition, what: str) -> None:  # noqa: ANN001
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def consume(stream) -> list[int]:  # noqa: ANN001
    last = None
    async for out in stream:
        last = out
    return last.outputs[0].token_ids


def start(engine: LLMEngine, max_waiting: int) -> tuple[AsyncEngine, ServerMetrics]:
    """An AsyncEngine with the server's gauge wired as build_app wires it."""
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, max_num_seqs=MAX_NUM_SEQS)
    metrics = ServerMetrics("test")
    metrics.attach_engine(lambda: async_engine.stats, lambda: async_engine.num_waiting, {})
    async_engine.start()
    return async_engine, metrics


def test_engine_stats_count_requests_waiting_for_a_slot(model_dir, adapters) -> None:  # noqa: F811
    """LLMEngine alone: a request parked outside the scheduler for a slot is waiting."""
    engine = lazy_engine(model_dir, adapters)
    engine.add_request("a", PROMPTS[1], PARAMS, lora_name="all")
    engine.step()  # "a" runs and holds the only slot
    assert engine.get_stats().num_requests_waiting == 0
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, n=2),
                       lora_name="attn-rs", priority=3)
    stats = engine.get_stats()
    assert stats.num_requests_running == 1
    assert stats.num_requests_waiting == 2 and stats.num_waiting_by_priority == {3: 2}
    engine.abort_request("b")
    assert engine.get_stats().num_requests_waiting == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.lora_registry.num_holds("all") == engine.lora_registry.num_holds("attn-rs") == 0
    assert_no_leaks(engine)


async def test_requests_waiting_for_a_first_load_count_and_fill_max_waiting(
        model_dir, adapters, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    engine = lazy_engine(model_dir, adapters)
    registry = engine.lora_registry
    load_gate = gate(monkeypatch, registry, "_load")
    async_engine, metrics = start(engine, max_waiting=2)
    try:
        first = [asyncio.create_task(async_engine.add(f"r{i}", PROMPTS[1], PARAMS,
                                                      lora_name="all")) for i in range(2)]
        await until(lambda: async_engine.num_waiting == 2, "two requests counted as waiting")
        assert registry.loaded == {} and registry.num_loads == 0  # the load is still running
        assert exported_waiting(metrics) == 2
        assert async_engine.num_waiting_ahead_of(0) == 2
        # The queue is full: a base-model request is refused though the batch has room.
        with pytest.raises(QueueFullError, match="2 requests are already waiting"):
            await async_engine.add("base", PROMPTS[1], PARAMS)
        # ...but not a more urgent one (max_waiting counts its own and more urgent requests).
        assert async_engine.num_waiting_ahead_of(-1) == 0
        load_gate.set()
        streams = await asyncio.wait_for(asyncio.gather(*first), timeout=60)
        outputs = await asyncio.wait_for(asyncio.gather(*map(consume, streams)), timeout=60)
        assert outputs[0] == outputs[1] and len(outputs[0]) == MAX_TOKENS
        assert registry.num_loads == 1  # the two shared one load
        await until(lambda: not engine.has_unfinished_requests(), "the engine is idle")
        assert async_engine.num_waiting == 0 and exported_waiting(metrics) == 0
        assert registry.num_holds("all") == 0
        assert_no_leaks(engine)
    finally:
        load_gate.set()
        async_engine.shutdown()


async def test_requests_waiting_for_a_held_slot_count_and_going_away_frees_their_place(
        model_dir, adapters, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    engine = lazy_engine(model_dir, adapters)
    registry = engine.lora_registry
    step_gate = gate(monkeypatch, engine.runner, "execute")
    async_engine, metrics = start(engine, max_waiting=2)
    try:
        # "holder" loads "all" and is admitted; its first step then waits on the gate, so
        # it holds the only slot until the test opens it.
        holder = await asyncio.wait_for(
            async_engine.add("holder", PROMPTS[1], PARAMS, lora_name="all"), timeout=60)
        assert registry.num_holds("all") == 1 and async_engine.num_waiting == 0
        waiters = {rid: asyncio.create_task(async_engine.add(rid, PROMPTS[1], PARAMS,
                                                             lora_name="attn-rs"))
                   for rid in ("w1", "w2")}
        await until(lambda: async_engine.num_waiting == 2, "two requests waiting for a slot")
        assert exported_waiting(metrics) == 2 and set(registry.loaded) == {"all"}
        assert async_engine.num_active == 3
        with pytest.raises(QueueFullError):
            await async_engine.add("base", PROMPTS[1], PARAMS)

        # A client that goes away while it waits gives its place back at once.
        waiters["w1"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiters["w1"]
        assert async_engine.num_waiting == 1 and exported_waiting(metrics) == 1
        assert async_engine.num_active == 2
        with pytest.raises(ValueError, match="duplicate request id 'w2'"):  # taken while it waits
            await async_engine.add("w2", PROMPTS[1], PARAMS)

        # An abort of everything (a drain that timed out) ends the one still waiting too.
        async_engine.abort_all("the server is shutting down")
        with pytest.raises(RequestAbortedError, match="shutting down"):
            await asyncio.wait_for(waiters["w2"], timeout=10)
        with pytest.raises(RequestAbortedError):
            await asyncio.wait_for(consume(holder), timeout=10)
        assert async_engine.num_waiting == 0 and async_engine.num_active == 0

        step_gate.set()
        await until(lambda: not engine.has_unfinished_requests(), "the engine is idle")
        # The waiters' threads got the slot once the holder's abort freed it (one load of
        # "attn-rs", shared) and gave it back, as nobody waited for it any more.
        await until(lambda: registry.num_loads == 2 and registry.num_holds("attn-rs") == 0,
                    "the abandoned holds are given back")
        assert registry.num_holds("all") == 0 and async_engine.num_waiting == 0
        # Nothing is left held: both adapters serve again, one after the other.
        for i, name in enumerate(("all", "attn-rs")):
            stream = await asyncio.wait_for(
                async_engine.add(f"after{i}", PROMPTS[1], PARAMS, lora_name=name), timeout=60)
            assert len(await asyncio.wait_for(consume(stream), timeout=60)) == MAX_TOKENS
        await until(lambda: not engine.has_unfinished_requests(), "the engine is idle")
        assert registry.num_holds("all") == registry.num_holds("attn-rs") == 0
        assert_no_leaks(engine)
    finally:
        step_gate.set()
        async_engine.shutdown()
