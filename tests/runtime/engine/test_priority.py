"""Request priorities on the real embedded model (float32, CPU): a high-priority request that
arrives while the batch is full preempts a low-priority one, and preemption never changes what
anyone generates (greedy tokens equal those of each request run alone)."""

from __future__ import annotations

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.request import RequestStatus
from engine_helpers import assert_no_leaks

pytestmark = pytest.mark.slow  # loads the embedded model

# SmolLM2-135M: 30 layers x (K, V) x 3 kv heads x 64 dims x 4 bytes x 16 tokens
BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16
LOW = {  # 20 and 14 prompt tokens: 2 + 1 blocks of 16
    "lo0": "SELECT name, email FROM users WHERE signup_date > 2020 AND country =",
    "lo1": "Once upon a time, in a land far away, there lived a",
}
HIGH = ("Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, melon, orange, "
        "peach, pear, plum,")  # 30 tokens: 2 blocks
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run_alone(engine: LLMEngine, prompt: str) -> list[int]:
    engine.add_request("alone", prompt, PARAMS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


@pytest.mark.parametrize("limit", ["max_num_seqs", "kv_blocks"])
def test_high_priority_preempts_and_outputs_are_unchanged(limit: str) -> None:
    # Either every seat is taken (max_num_seqs=2) or the KV pool is short: 4 blocks, 3 held by
    # the low-priority requests, and the high-priority prompt needs 2.
    kw = ({"max_num_seqs": 2} if limit == "max_num_seqs"
          else {"kv_cache_memory": 4 * BLOCK_BYTES, "block_size": 16})
    engine = LLMEngine(model="smollm2-135m", dtype="float32", **kw)
    expected = {rid: run_alone(engine, p) for rid, p in {**LOW, "hi": HIGH}.items()}
    engine.kv_cache.pool.reset_prefix_cache()  # the contended run recomputes from scratch

    for rid, prompt in LOW.items():
        engine.add_request(rid, prompt, PARAMS, priority=1)
    done: dict[str, list[int]] = {}
    finish_order: list[str] = []

    def step() -> set[str]:
        outs = engine.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                finish_order.append(out.request_id)
        return {out.request_id for out in outs}

    for _ in range(3):
        assert step() == {"lo0", "lo1"}
    engine.add_request("hi", HIGH, PARAMS, priority=0)
    # Admitted at the very next step, in place of the newest low-priority request.
    assert step() == {"lo0", "hi"}
    lo1 = engine.scheduler.requests["lo1"]
    assert lo1.status == RequestStatus.PREEMPTED and lo1.num_output_tokens == 3
    assert engine.get_stats().num_preemptions >= 1
    while engine.has_unfinished_requests():
        step()

    assert done == expected
    assert finish_order.index("hi") < finish_order.index("lo1")
    assert_no_leaks(engine)
