"""Speculation under a tight KV pool: drafts are a bet, not owed (docs/speculative.md). A
draft proposer must not hold target blocks for drafts when the scheduler preempts: the
scheduler drops a request's drafts before it preempts anyone for them, and that only works
when the drafts' blocks are still free when it runs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from argosy_runtime.scheduler import Scheduler  # noqa: E402
from engine_helpers import assert_no_leaks  # noqa: E402
from engine_helpers import run_to_completion as run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 2048  # bytes of a float32 block of 4 tokens of the 2-layer random model


def random_prompts(seed: int, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(*lengths))] for _ in range(n)]


# (draft, prompts seed, number, length range, k, target blocks): workloads where a proposer
# that took the drafts' target blocks before the scheduler ran left a victim holding them.
CASES = {
    "self": ({"draft_layers": 1}, 1, 8, (6, 14), 4, 14),
    "copy": ({"model": "copy"}, 3, 6, (4, 12), 4, 16),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_no_preemption_victim_holds_blocks_for_ungranted_drafts(
        kind: str, target_and_copy: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    draft, seed, n, lengths, k, blocks = CASES[kind]
    if "model" in draft:
        draft = {"model": str(target_and_copy[draft["model"]])}
    prompts = random_prompts(seed, n, lengths)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)
    expected = run(LLMEngine(model=str(target_and_copy["target"]), **options), prompts, params)

    # Blocks each victim holds past its own tokens, when the scheduler preempts it. Equal
    # priorities: victims come from the back of the running list, not yet scheduled this
    # step, so whatever they hold past their tokens no step granted them.
    surplus: list[int] = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, req) -> None:  # noqa: ANN001
        kv = self.kv_cache
        held = len(kv.req_to_blocks.get(req.request_id, ()))
        surplus.append(held - -(-req.num_tokens // kv.block_size))
        preempt(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    separate = "model" in draft  # its own cache takes a block per target block
    engine = LLMEngine(model=str(target_and_copy["target"]), **options,
                       kv_cache_memory=blocks * BLOCK * (2 if separate else 1),
                       speculative={"method": "draft", "num_speculative_tokens": k,
                                    "adaptive": False, **draft})
    assert engine.kv_cache.num_blocks == blocks
    assert run(engine, prompts, params) == expected
    assert surplus, "the pool is tight enough to preempt"
    assert max(surplus) <= 0, surplus
    assert engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)
