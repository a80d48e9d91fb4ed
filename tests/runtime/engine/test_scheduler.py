"""Scheduler policy on the pure-Python side: budgets, chunked prefill, preemption, priority."""

from __future__ import annotations

from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler, SchedulerOutput


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 16, max_seqs: int = 8,
         chunked: bool = True, max_model_len: int = 256,
         long_prefill: int | None = None) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=long_prefill)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def req(rid: str, n_prompt: int, t: float, priority: int = 0, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=50),
                   max_tokens=50, arrival_time=t, priority=priority)


def run_step(s: Scheduler, sampled_token: int = 7) -> dict[str, int]:
    """Schedule, then advance like the engine: computed tokens, one sampled token per completion."""
    return advance(s.schedule(), sampled_token)


def advance(out: SchedulerOutput, sampled_token: int = 7) -> dict[str, int]:
    """Advance the scheduled requests of `out` like the engine; returns {id: tokens fed}."""
    counts = {}
    for sr in out.scheduled:
        r = sr.request
        done = sr.completes_sequence
        r.num_computed_tokens += sr.num_new_tokens
        if done:
            r.token_ids.append(sampled_token)
        counts[r.request_id] = sr.num_new_tokens
    return counts


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    s = make(budget=8)
    a = req("a", 3, 0.0)
    s.add_request(a)
    assert run_step(s) == {"a": 3}
    s.add_request(req("long", 20, 1.0, base=100))
    steps = [run_step(s) for _ in range(3)]
    # Every step decodes "a" (1 token) and gives the rest of the budget to the long prompt.
    assert steps == [{"a": 1, "long": 7}, {"a": 1, "long": 7}, {"a": 1, "long": 6}]
    assert s.requests["long"].num_output_tokens == 1


def test_long_prefill_token_threshold_leaves_room_for_the_prompts_behind() -> None:
    uncapped, capped = make(budget=16), make(budget=16, long_prefill=6)
    for s in (uncapped, capped):
        s.add_request(req("long", 30, 0.0))
        s.add_request(req("short", 3, 1.0, base=100))
    # Uncapped, the long prompt takes the budget and the short one gets a 2-token chunk.
    assert run_step(uncapped) == {"long": 16}
    assert run_step(uncapped) == {"long": 14, "short": 2}
    # Capped, both prefill in the first step: the short prompt samples its first token.
    assert run_step(capped) == {"long": 6, "short": 3}
    assert capped.requests["short"].num_output_tokens == 1
    assert run_step(capped) == {"long": 6, "short": 1}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    s = make(budget=32, chunked=False, max_model_len=32)
    s.add_request(req("a", 10, 0.0))
    s.add_request(req("b", 30, 1.0, base=50))
    assert run_step(s) == {"a": 10}  # b (30) does not fit beside a in 32 tokens
    assert run_step(s) == {"a": 1, "b": 30}


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = make(max_seqs=2, budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 2, float(i), base=10 * i))
    assert set(run_step(s)) == {"r0", "r1"}
    assert s.num_waiting == 2


def test_preemption_takes_the_newest_request_and_it_resumes_later() -> None:
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens fill 4 blocks, then decodes grow.
    s = make(num_blocks=6, block_size=4, budget=64)
    old, new = req("old", 8, 0.0), req("new", 8, 1.0, base=100)
    s.add_request(old)
    s.add_request(new)
    run_step(s)
    for _ in range(12):
        run_step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1
    assert new.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    assert new.num_computed_tokens == 0
    assert old.status == RequestStatus.RUNNING
    s.finish_request(old, RequestStatus.FINISHED_STOPPED)
    run_step(s)
    assert new.status == RequestStatus.RUNNING
    # Recompute prefills everything it had (prompt + generated tokens) again.
    assert new.num_computed_tokens + 1 == new.num_tokens
    s.finish_request(new, RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.num_free_blocks == 6


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted() -> None:
    # 4 blocks of 4: a and b (8 tokens each after two steps) hold two each. a's three ngram
    # drafts would need a third block; without them both still fit.
    s = make(num_blocks=4, block_size=4, budget=32)
    a, b = req("a", 6, 0.0), req("b", 6, 1.0, base=50)
    s.add_request(a)
    s.add_request(b)
    assert run_step(s) == {"a": 6, "b": 6}
    assert run_step(s) == {"a": 1, "b": 1}
    assert s.kv_cache.pool.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.preempted == []  # b was preempted for a's drafts before
    assert [(sr.request.request_id, sr.num_new_tokens, sr.num_spec_tokens)
            for sr in out.scheduled] == [("a", 1, 0), ("b", 1, 0)]


def test_drafts_that_fit_are_scheduled() -> None:
    s = make(num_blocks=8, block_size=4, budget=32)
    a = req("a", 6, 0.0)
    s.add_request(a)
    run_step(s)
    run_step(s)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert [(sr.num_new_tokens, sr.num_spec_tokens) for sr in out.scheduled] == [(4, 3)]


def test_lower_priority_value_is_admitted_first() -> None:
    s = make(max_seqs=1, budget=64)
    s.add_request(req("late-but-urgent", 2, 5.0, priority=-1))
    s.add_request(req("early", 2, 0.0, priority=0, base=50))
    assert set(run_step(s)) == {"late-but-urgent"}


def test_prefix_hit_skips_cached_tokens() -> None:
    s = make(budget=64)
    first = req("first", 13, 0.0)
    s.add_request(first)
    run_step(s)
    second = req("second", 13, 1.0)  # same tokens
    s.add_request(second)
    counts = run_step(s)
    assert counts["second"] == 1  # 12 tokens (3 blocks) came from the cache
    assert second.num_cached_tokens == 12


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {sr.request.request_id: sr.num_new_tokens for sr in out.scheduled}


def two_running_priority_1(budget: int = 64) -> tuple[Scheduler, Request, Request]:
    """max_num_seqs=2, both seats taken by decoding priority-1 requests."""
    s = make(max_seqs=2, budget=budget)
    old, new = req("lo-old", 4, 0.0, priority=1), req("lo-new", 4, 1.0, priority=1, base=20)
    s.add_request(old)
    s.add_request(new)
    assert run_step(s) == {"lo-old": 4, "lo-new": 4}
    return s, old, new


def test_higher_priority_preempts_the_newest_lower_one_at_max_num_seqs() -> None:
    s, old, new = two_running_priority_1()
    s.add_request(req("urgent", 4, 2.0, priority=0, base=40))
    out = s.schedule()
    assert scheduled(out) == {"lo-old": 1, "urgent": 4}
    assert out.preempted == [new]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting == [new] and s.kv_cache.block_ids("lo-new") == []
    assert s.num_preemptions == 1
    advance(out)
    # The victim comes back once a seat is free; its prompt block is still in the prefix
    # cache, so only its sampled token is recomputed.
    s.finish_request(s.requests["urgent"], RequestStatus.FINISHED_STOPPED)
    assert run_step(s) == {"lo-old": 1, "lo-new": 1}
    assert new.status == RequestStatus.RUNNING


def test_equal_priority_never_preempts() -> None:
    s, old, new = two_running_priority_1()
    s.add_request(req("late", 4, 2.0, priority=1, base=40))
    for _ in range(5):
        out = s.schedule()
        assert scheduled(out) == {"lo-old": 1, "lo-new": 1}
        assert out.preempted == []
        advance(out)
    assert s.num_preemptions == 0
    assert [r.request_id for r in s.waiting] == ["late"]


def test_higher_priority_preempts_when_kv_blocks_are_short() -> None:
    # 4 blocks of 4 tokens. "lo" (8 prompt tokens) holds 3 blocks once decoding; "urgent"
    # (9 tokens) needs 3, and only 1 is free.
    s = make(num_blocks=4, block_size=4, budget=64)
    lo = req("lo", 8, 0.0, priority=1)
    s.add_request(lo)
    assert run_step(s) == {"lo": 8}
    s.add_request(req("urgent", 9, 1.0, priority=0, base=100))
    out = s.schedule()
    assert scheduled(out) == {"urgent": 9}
    assert out.preempted == [lo] and lo.status == RequestStatus.PREEMPTED
    advance(out)
    assert s.kv_cache.num_free_blocks == 1  # lo's blocks went to urgent
    s.finish_request(s.requests["urgent"], RequestStatus.FINISHED_STOPPED)
    run_step(s)
    assert lo.status == RequestStatus.RUNNING and lo.num_computed_tokens + 1 == lo.num_tokens
    s.finish_request(lo, RequestStatus.FINISHED_STOPPED)
    assert s.kv_cache.num_free_blocks == 4


def test_nobody_is_preempted_for_a_head_that_would_still_not_fit() -> None:
    # 8 blocks of 4 tokens. "hi" (priority 0, 20 tokens) holds 6 blocks, "lo" (priority 1,
    # 4 tokens) 2 once decoding; "urgent" (priority 0, 16 tokens) needs 4 blocks. Preempting
    # lo frees 2, which is not enough (hi it does not outrank): lo must keep running.
    s = make(num_blocks=8, block_size=4, budget=64)
    lo = req("lo", 4, 1.0, priority=1, base=100)
    s.add_request(req("hi", 20, 0.0, priority=0))
    s.add_request(lo)
    assert run_step(s) == {"hi": 20, "lo": 4}
    s.add_request(req("urgent", 16, 2.0, priority=0, base=200))
    for _ in range(3):
        out = s.schedule()
        assert scheduled(out) == {"hi": 1, "lo": 1} and out.preempted == []
        advance(out)
    assert s.num_preemptions == 0 and [r.request_id for r in s.waiting] == ["urgent"]
    # Once hi is gone, preempting lo is no longer needed either: urgent fits as it is.
    s.finish_request(s.requests["hi"], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert scheduled(out) == {"lo": 1, "urgent": 16} and out.preempted == []


def test_no_seat_is_taken_for_a_head_whose_blocks_would_still_be_short() -> None:
    # Both seats taken: "hi" (priority 0) holds 6 of 8 blocks, "lo" (priority 1) 2. Preempting
    # lo frees a seat but only 2 blocks; "urgent" needs 4.
    s = make(num_blocks=8, block_size=4, budget=64, max_seqs=2)
    lo = req("lo", 4, 1.0, priority=1, base=100)
    s.add_request(req("hi", 20, 0.0, priority=0))
    s.add_request(lo)
    assert run_step(s) == {"hi": 20, "lo": 4}
    s.add_request(req("urgent", 16, 2.0, priority=0, base=200))
    out = s.schedule()
    assert scheduled(out) == {"hi": 1, "lo": 1} and out.preempted == []
    assert lo.status == RequestStatus.RUNNING
    # A short urgent request fits in lo's seat and blocks: lo is preempted for it.
    s2 = make(num_blocks=8, block_size=4, budget=64, max_seqs=2)
    s2.add_request(req("hi", 20, 0.0, priority=0))
    s2.add_request(req("lo", 4, 1.0, priority=1, base=100))
    run_step(s2)
    s2.add_request(req("urgent", 4, 2.0, priority=0, base=200))
    out = s2.schedule()
    assert scheduled(out) == {"hi": 1, "urgent": 4}
    assert [r.request_id for r in out.preempted] == ["lo"]


def test_a_victim_scheduled_in_step_1_is_unscheduled_and_its_tokens_return() -> None:
    s, old, new = two_running_priority_1(budget=8)
    s.add_request(req("urgent", 20, 2.0, priority=0, base=40))
    out = s.schedule()
    # Step 1 gave lo-old and lo-new 1 token each; preempting lo-new gives its token back,
    # so urgent's first chunk is 7 tokens, not 6.
    assert scheduled(out) == {"lo-old": 1, "urgent": 7}
    assert out.num_batched_tokens == 8
    assert out.preempted == [new] and new not in s.running


def test_prefix_cache_counters_count_a_waiting_request_once_when_admitted() -> None:
    """A request held at the head of the queue (blocks short) is looked up in the prefix cache
    every step; only its admission counts, so the counters agree with its num_cached_tokens
    (what the server reports as cached_tokens) and the hit rate is not skewed toward it."""
    s = make(num_blocks=6, budget=32)
    a = req("a", 21, 0.0)  # 6 blocks, enough until it passes 24 tokens
    s.add_request(a)
    run_step(s)
    s.add_request(req("b", 17, 1.0))  # a's first 4 blocks are hits; its 5th: none free
    for _ in range(3):
        assert run_step(s) == {"a": 1}
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (21, 0)
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert run_step(s) == {"b": 1}
    assert s.requests["b"].num_cached_tokens == 16
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (21 + 17, 16)


def test_blocks_recomputed_beside_a_cached_copy_do_not_outlive_the_cached_copy() -> None:
    """A request that may not take prefix hits (prompt_logprobs here; mean pooling too)
    recomputes blocks the cache already holds. Those copies are never found by a lookup (the
    first block cached for a hash keeps it), so once free they must be evicted first, like
    any uncached block: kept at the back of the LRU they outlived the cached originals, and
    the prefix was lost from the cache while useless copies stayed."""
    s = make(num_blocks=9, block_size=4, budget=64)
    a = req("a", 9, 0.0)  # 2 full blocks + 1 token
    s.add_request(a)
    assert run_step(s) == {"a": 9}
    scored = Request("scored", list(range(9)), SamplingParams(max_tokens=5, prompt_logprobs=1),
                     max_tokens=5, arrival_time=1.0)
    s.add_request(scored)
    assert run_step(s) == {"a": 1, "scored": 9}  # no hits: it scores every prompt token
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    s.finish_request(scored, RequestStatus.FINISHED_STOPPED)
    # An unrelated request takes 6 of the 9 free blocks: a's prefix must be among the 3 kept.
    s.add_request(req("other", 21, 2.0, base=100))
    assert run_step(s) == {"other": 21}
    again = req("again", 9, 3.0)
    s.add_request(again)
    assert run_step(s) == {"other": 1, "again": 1}
    assert again.num_cached_tokens == 8


def test_requests_that_may_not_read_the_cache_are_no_prefix_cache_queries() -> None:
    """A request scoring every prompt token (prompt_logprobs) takes no hits, so it asks the
    cache nothing: counted as all misses, it lowered the hit rate of the requests that can
    use it (vLLM records no lookup for such requests)."""
    s = make(num_blocks=9, block_size=4, budget=64)
    s.add_request(req("a", 9, 0.0))
    assert run_step(s) == {"a": 9}
    s.add_request(Request("scored", list(range(9)),
                          SamplingParams(max_tokens=5, prompt_logprobs=1), max_tokens=5,
                          arrival_time=1.0))
    assert run_step(s) == {"a": 1, "scored": 9}
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (9, 0)
    s.add_request(req("b", 9, 2.0))
    run_step(s)
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (18, 8)


def test_prefix_cache_counters_do_not_count_a_preempted_request_again() -> None:
    """A preempted request is looked up again when re-admitted and mostly hits its own blocks.
    Counting that would inflate the hit rate with recomputation (vLLM counts preempted
    lookups apart) and break the counters' agreement with the requests' num_cached_tokens."""
    s, old, new = two_running_priority_1()
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (8, 0)
    s.add_request(req("urgent", 4, 2.0, priority=0, base=40))
    out = s.schedule()
    assert out.preempted == [new]
    advance(out)
    s.finish_request(s.requests["urgent"], RequestStatus.FINISHED_STOPPED)
    assert run_step(s) == {"lo-old": 1, "lo-new": 1}  # new is back, its prompt block a hit
    assert new.num_cached_tokens == 0
    assert (s.kv_cache.prefix_cache_queries, s.kv_cache.prefix_cache_hits) == (12, 0)


def test_without_chunked_prefill_nobody_is_preempted_for_a_head_the_budget_cannot_take() -> None:
    """Without chunked prefill a head runs its whole prompt in one step. Preempting one
    decode for a seat gives back a single token of budget: if the head still does not fit,
    it must not have cost that victim its place (it used to be preempted, and the head
    was not admitted either). Preempting every request it outranks gives back enough."""
    s = make(max_seqs=3, budget=32, chunked=False, max_model_len=32)
    for i in range(3):
        s.add_request(req(f"lo{i}", 4, float(i), priority=1, base=10 * i))
    assert run_step(s) == {"lo0": 4, "lo1": 4, "lo2": 4}
    s.add_request(req("urgent", 31, 5.0, priority=0, base=100))
    out = s.schedule()
    # 3 decodes leave 29 tokens; urgent needs 31: two victims' tokens must come back.
    assert scheduled(out) == {"lo0": 1, "urgent": 31}
    assert [r.request_id for r in out.preempted] == ["lo2", "lo1"]
    assert out.num_batched_tokens <= 32


def test_without_chunked_prefill_a_head_that_cannot_fit_preempts_nobody() -> None:
    s = make(max_seqs=2, budget=32, chunked=False, max_model_len=32)
    s.add_request(req("hi", 4, 0.0, priority=0))
    s.add_request(req("lo", 4, 1.0, priority=1, base=10))
    assert run_step(s) == {"hi": 4, "lo": 4}
    s.add_request(req("urgent", 32, 5.0, priority=0, base=100))  # needs all 32 tokens
    for _ in range(3):
        out = s.schedule()
        # Even with lo preempted, hi's decode leaves 31: lo keeps its seat.
        assert scheduled(out) == {"hi": 1, "lo": 1} and out.preempted == []
        advance(out)
    assert s.num_preemptions == 0


def test_a_seat_victims_returned_tokens_never_grow_a_chunk_past_the_blocks_checked() -> None:
    """The blocks for a head's first chunk are checked before its seat is taken; the seat's
    victim, scheduled in step 1, then gives its token back. A chunk grown by that token past
    a block boundary needs a block nobody can give: the victim was preempted for nothing
    and the head not admitted. It keeps the chunk whose blocks were checked instead."""
    s = make(num_blocks=5, block_size=4, budget=6, max_seqs=2)
    hi = req("hi", 15, 0.0, priority=0)
    lo = req("lo", 3, 1.0, priority=1, base=100)
    s.add_request(hi)
    s.add_request(lo)
    for _ in range(3):
        run_step(s)
    assert (hi.num_tokens, lo.num_tokens, s.kv_cache.num_free_blocks) == (16, 4, 0)
    s.add_request(req("urgent", 20, 5.0, priority=0, base=200))
    out = s.schedule()
    # Step 1: hi 1 + lo 1 leaves 4 tokens, one block: lo's. Not 5 tokens, two blocks.
    assert scheduled(out) == {"hi": 1, "urgent": 4}
    assert out.preempted == [lo]


def test_a_seat_victims_returned_tokens_never_cost_another_victim() -> None:
    """Growing the head's chunk by the seat victim's returned token (4 -> 5 tokens: a second
    block) could be paid for by preempting another request it outranks: lo1 would lose its
    work for one token of urgent's first chunk. The chunk stays the one checked; lo1 runs."""
    s = make(num_blocks=5, block_size=4, budget=7, max_seqs=3)
    s.add_request(req("hi", 3, 0.0, priority=0))
    s.add_request(req("lo1", 3, 1.0, priority=1, base=100))
    lo2 = req("lo2", 3, 2.0, priority=1, base=200)
    s.add_request(lo2)
    assert run_step(s) == {"hi": 3, "lo1": 3, "lo2": 1}
    assert run_step(s) == {"hi": 1, "lo1": 1, "lo2": 2}
    s.add_request(req("urgent", 20, 5.0, priority=0, base=300))
    out = s.schedule()
    # Step 1 takes both free blocks (hi's and lo1's 5th token) and 3 of the 7 tokens.
    assert scheduled(out) == {"hi": 1, "lo1": 1, "urgent": 4}
    assert out.preempted == [lo2]
    assert s.kv_cache.num_free_blocks == 0
