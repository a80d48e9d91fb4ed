"""What the AsyncEngine tells the server's metrics (a recording observer stands in for the
Prometheus histograms): inter-token latency once per token of every sequence, and requests
that end without an answer (aborted, failed) counted with their reason."""

from __future__ import annotations

import asyncio

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import AsyncEngine, EngineDeadError
from engine_helpers import fail_the_nth_step


class Recorder:
    def __init__(self) -> None:
        self.first_tokens = 0
        self.gaps: list[int] = []  # tokens per on_tokens call
        self.finished: list[tuple[str | None, int]] = []  # (reason, generated tokens)

    def on_scheduled(self, queue_time_s: float) -> None:
        pass

    def on_first_token(self, ttft_s: float) -> None:
        self.first_tokens += 1

    def on_tokens(self, gap_s: float, num_tokens: int) -> None:
        self.gaps.append(num_tokens)

    def on_finished(self, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int,
                    finish_reason: str | None) -> None:
        self.finished.append((finish_reason, num_generation_tokens))


@pytest.fixture
def engine(random_llama_dir) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                     max_model_len=256, kv_cache_memory=256 * 4 * 512, max_num_seqs=1)


async def _run(engine: LLMEngine, body) -> Recorder:  # noqa: ANN001
    recorder = Recorder()
    async_engine = AsyncEngine(engine, observer=recorder)
    async_engine.start()
    try:
        await asyncio.wait_for(body(async_engine), timeout=60)
        for _ in range(500):  # the worker thread applies aborts after the stream ends
            if not engine.has_unfinished_requests() and not async_engine._commands:
                break
            await asyncio.sleep(0.01)
    finally:
        async_engine.shutdown()
    return recorder


async def test_every_token_after_each_sequences_first_is_one_inter_token_latency(
        random_llama_dir) -> None:  # noqa: ANN001
    # n = 3 in one step each: 5 tokens per sequence, 4 of them after its first (was one
    # observation per step for all three: 4 instead of 12).
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_model_len=256, kv_cache_memory=256 * 4 * 512)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=0, ignore_eos=True)

    async def body(async_engine: AsyncEngine) -> None:
        async for _ in await async_engine.add("n3", [5, 6, 7], params):
            pass

    recorder = await _run(engine, body)
    assert sum(recorder.gaps) == 3 * 4
    assert recorder.first_tokens == 1 and recorder.finished == [("length", 15)]


async def test_a_request_aborted_while_waiting_is_counted_but_not_its_prompt(
        engine: LLMEngine) -> None:
    # One seat: the second request waits, and its client leaves before it runs.
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def body(async_engine: AsyncEngine) -> None:
        first = await async_engine.add("first", [5, 6, 7, 8], long)
        waiting = await async_engine.add("waiting", list(range(10, 50)), long)
        waiting.close()
        async for _ in first:
            pass

    recorder = await _run(engine, body)
    assert engine.get_stats().prompt_tokens == 4  # the waiting one's 40 never ran
    assert sorted(recorder.finished) == [("abort", 0), ("length", 30)]


async def test_the_requests_of_a_failed_step_are_counted_as_errors(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_the_nth_step(engine, monkeypatch, 3)

    async def body(async_engine: AsyncEngine) -> None:
        with pytest.raises(EngineDeadError):
            async for _ in await async_engine.add("doomed", [5, 6, 7], SamplingParams(
                    max_tokens=30, temperature=0, ignore_eos=True)):
                pass

    recorder = await _run(engine, body)
    assert recorder.finished == [("error", 2)]
