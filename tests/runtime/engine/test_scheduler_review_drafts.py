"""Scheduler review: speculative drafts never cost another request its place."""

from __future__ import annotations

from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler


def _scheduler(num_blocks: int, budget: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size=4))


def _req(rid: str, n_prompt: int, t: float, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=20),
                   max_tokens=20, arrival_time=t)


def _step(s: Scheduler) -> None:
    for sr in s.schedule().scheduled:
        done = sr.completes_sequence
        sr.request.num_computed_tokens += sr.num_new_tokens
        if done:
            sr.request.token_ids.append(7)


def _a_and_b_after_their_prompts(num_blocks: int, a_len: int, b_len: int
                                 ) -> tuple[Scheduler, Request, Request]:
    """Requests a (first) and b, their prompts run: both decoding."""
    s = _scheduler(num_blocks=num_blocks)
    a, b = _req("a", a_len, 0.0), _req("b", b_len, 1.0, base=50)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    return s, a, b


def test_drafts_of_a_request_ahead_are_dropped_before_a_later_one_is_preempted() -> None:
    # 5 blocks of 4. After the prompts: a (7 tokens) holds 2 blocks, b (9 tokens) 2, one free.
    # a's 3 drafts need a 3rd block (slots 6..9), b's next token (slot 8) needs a 3rd block.
    # The free block must go to b's token: a's drafts are a bet, b's recomputation is not.
    s, a, b = _a_and_b_after_their_prompts(5, 6, 8)
    assert (a.num_tokens, b.num_tokens, s.kv_cache.num_free_blocks) == (7, 9, 1)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.preempted == [] and s.num_preemptions == 0
    assert b.status == RequestStatus.RUNNING
    assert [(sr.request.request_id, sr.num_new_tokens, sr.num_spec_tokens)
            for sr in out.scheduled] == [("a", 1, 0), ("b", 1, 0)]
    # a's draft block went back: a holds the 2 blocks of its 7 tokens, b took the free one.
    assert len(s.kv_cache.block_ids("a")) == 2 and len(s.kv_cache.block_ids("b")) == 3
    assert s.kv_cache.num_free_blocks == 0
    assert out.num_batched_tokens == 2


def test_drafts_that_do_not_cost_anyone_are_kept() -> None:
    # Same, with one more block: a's drafts and b's token both fit.
    s, a, b = _a_and_b_after_their_prompts(6, 6, 8)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.preempted == []
    assert [(sr.request.request_id, sr.num_new_tokens, sr.num_spec_tokens)
            for sr in out.scheduled] == [("a", 4, 3), ("b", 1, 0)]


def test_drafts_inside_their_last_block_are_kept_when_someone_is_preempted_anyway() -> None:
    # 4 blocks of 4, none free after the prompts: a (6 tokens) holds 2 blocks and its 2
    # drafts (slots 5..7) fit in them; b (9 tokens) needs a 3rd block for its next token.
    # Dropping a's drafts frees nothing: b is preempted either way, a keeps its drafts.
    s, a, b = _a_and_b_after_their_prompts(4, 5, 8)
    assert (a.num_tokens, b.num_tokens, s.kv_cache.num_free_blocks) == (6, 9, 0)
    a.spec_token_ids = [1, 2]
    out = s.schedule()
    assert out.preempted == [b]
    assert [(sr.request.request_id, sr.num_new_tokens, sr.num_spec_tokens)
            for sr in out.scheduled] == [("a", 3, 2)]
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.num_free_blocks == 4


def test_a_waiting_head_takes_drafts_blocks_before_it_preempts_anyone() -> None:
    # 4 blocks of 4. a (priority 0, 7 tokens) holds 2, v (priority 1, 4 tokens) 1; a's 3
    # drafts take the last free block in step 1. Urgent h (priority 0, 4 tokens) needs one
    # block: a's drafts give it back, and v, which h outranks, keeps its place.
    s = _scheduler(num_blocks=4)
    a = _req("a", 6, 0.0)
    v = Request("v", [50, 51, 52], SamplingParams(max_tokens=20), max_tokens=20,
                arrival_time=1.0, priority=1)
    s.add_request(a)
    s.add_request(v)
    _step(s)
    assert s.kv_cache.num_free_blocks == 1
    a.spec_token_ids = [1, 2, 3]
    h = Request("h", [100, 101, 102, 103], SamplingParams(max_tokens=20), max_tokens=20,
                arrival_time=2.0, priority=0)
    s.add_request(h)
    out = s.schedule()
    assert out.preempted == [] and v.status == RequestStatus.RUNNING
    assert [(sr.request.request_id, sr.num_new_tokens, sr.num_spec_tokens)
            for sr in out.scheduled] == [("a", 1, 0), ("v", 1, 0), ("h", 4, 0)]
    assert len(s.kv_cache.block_ids("a")) == 2 and s.kv_cache.num_free_blocks == 0
