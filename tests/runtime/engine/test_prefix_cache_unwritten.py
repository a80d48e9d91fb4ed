"""The prefix cache never offers a block whose K/V were not written.

`KVCacheManager.allocate_slots` makes the full blocks a step is about to compute prefix-cache
entries at scheduling time, so a request admitted later in the same step can share them (every
layer writes the step's K/V before attention reads them). That is only right if the step runs
those tokens. Two ways it does not:

- a request scheduled in the running phase is preempted in the waiting phase for a request of
  higher priority (strictly lower priority value): taken out of the step, its blocks freed;
- the forward raises (`AsyncEngine` then aborts the requests in flight, freeing their blocks).

Either way the blocks hashed for the step must not stay in the cache (a later request with the
same prefix would read garbage), and no request of the same step may hold them as hits.
Outputs are checked against transformers (float32) on the random 2-layer Llama.
"""

from __future__ import annotations

import pytest
from argosy_runtime import LLMEngine
from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler
from engine_helpers import assert_no_leaks, greedy, random_prompts, scheduler_step

N = 8  # generated tokens per request
NULL_BLOCK = 0  # a sliding-window pool's reserved block
# Random Llama: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token.
BLOCK_BYTES = 4 * 512


def make_engine(path, max_num_seqs: int) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32,
                     max_num_seqs=max_num_seqs, kv_cache_memory=64 * BLOCK_BYTES)


def step_until_done(engine: LLMEngine, done: dict) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out


def matches(ref, prompt: list[int], out) -> bool:  # noqa: ANN001
    """Greedy tokens equal transformers', logprobs within 1e-4."""
    logprobs = ref.greedy_logprobs(prompt, N)
    seq = out.outputs[0]
    return seq.token_ids == ref.greedy(prompt, N) and all(
        abs(seq.logprobs[pos][token].logprob - logprobs[pos][token].item()) < 1e-4
        for pos, token in enumerate(seq.token_ids))


@pytest.mark.parametrize("case", ["victim_readmitted", "head_shares_prefix",
                                  "earlier_admission_shares_prefix"])
def test_preempted_victims_unwritten_blocks_are_never_hits(case: str, random_llama_dir,  # noqa: ANN001
                                                           random_llama_hf) -> None:
    """lo0 (4 tokens) and the victim (40 tokens), priority 1, 32-token steps, 4-token blocks.
    Step A: lo0's prompt and the victim's first 28 tokens. Step B: lo0 decodes, the victim's
    last 12 tokens (blocks 7-9 hashed at scheduling) - and a priority-0 request arriving now
    preempts the victim, so those 12 tokens never run.
    - victim_readmitted: the head's prompt is unrelated; the victim comes back later and must
      not take blocks 7-8 from the cache;
    - head_shares_prefix: the head's prompt starts with the victim's first 36 tokens, and its
      prefix lookup (made before the preemption) must not include blocks 7-8;
    - earlier_admission_shares_prefix: a third seat; a priority-0 request sharing the prefix
      is admitted first in the same waiting phase, then an unrelated priority-0 one preempts
      the victim."""
    engine = make_engine(random_llama_dir, 3 if case == "earlier_admission_shares_prefix" else 2)
    lo0, victim, tail, other = random_prompts(11, (4, 40, 5, 9))
    prompts = {"lo0": lo0, "victim": victim}
    engine.add_request("lo0", lo0, greedy(N), priority=1)
    engine.add_request("victim", victim, greedy(N), priority=1)
    engine.step()  # step A
    assert engine.scheduler.requests["victim"].num_computed_tokens == 28
    if case == "victim_readmitted":
        prompts["head"] = other
    elif case == "head_shares_prefix":
        prompts["head"] = victim[:36] + tail
    else:
        prompts["sharer"] = victim[:36] + tail[:2]
        prompts["head"] = other
    for rid in ("sharer", "head"):
        if rid in prompts:
            engine.add_request(rid, prompts[rid], greedy(N), priority=0)
    done: dict = {}
    for out in engine.step():  # step B
        if out.finished:
            done[out.request_id] = out
    assert engine.scheduler.requests["victim"].status == RequestStatus.PREEMPTED
    assert engine.get_stats().num_preemptions == 1
    if case == "victim_readmitted":  # (its re-admission is not counted in the stats)
        # The victim's blocks written in step A (28 tokens) are still hits; 7-8 are not.
        assert len(engine.kv_cache.get_computed_blocks("victim", victim)) == 7
    step_until_done(engine, done)
    wrong = [rid for rid, prompt in prompts.items()
             if not matches(random_llama_hf, prompt, done[rid])]
    assert wrong == []
    if case != "victim_readmitted":  # The victim's blocks written in step A are still hits.
        assert engine.get_stats().prefix_cache_hits >= 28
    assert_no_leaks(engine)


def test_a_failed_step_leaves_no_cache_entries(random_llama_dir, random_llama_hf,  # noqa: ANN001
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward raises (as AsyncEngine sees it: it then aborts the requests in flight). The
    blocks hashed for that step were never written: the same prompt sent again must compute
    them, not take them from the cache."""
    engine = make_engine(random_llama_dir, 4)
    (prompt,) = random_prompts(12, (44,))
    engine.add_request("r0", prompt, greedy(N))
    engine.step()  # 32 tokens: blocks 0-7 written
    runner = engine.runner
    real_execute = runner.execute

    def failing_execute(sched):  # noqa: ANN001, ANN202
        raise RuntimeError("simulated device error")

    monkeypatch.setattr(runner, "execute", failing_execute)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()  # would compute tokens 32-43 (blocks 8-10 hashed at scheduling)
    engine.abort_request("r0")
    monkeypatch.setattr(runner, "execute", real_execute)
    done: dict = {}
    engine.add_request("again", prompt, greedy(N))
    step_until_done(engine, done)
    assert matches(random_llama_hf, prompt, done["again"])
    assert engine.scheduler.requests == {} and done["again"].num_cached_tokens == 32
    assert_no_leaks(engine)



def test_a_decode_victims_unwritten_last_token_is_never_a_hit(random_llama_dir,  # noqa: ANN001
                                                             random_llama_hf) -> None:
    """The victim (7 prompt tokens) decodes position 7 in step B, which fills its block 1
    (hashed at scheduling), and is preempted in that step. Its recompute later cannot repair
    the entry (the first block cached for a hash stays the entry), so a later request whose
    prompt extends the victim's first 8 tokens would read the unwritten position 7."""
    engine = make_engine(random_llama_dir, 2)
    lo0, victim, other, extra = random_prompts(13, (4, 7, 5, 3))
    engine.add_request("lo0", lo0, greedy(N), priority=1)
    engine.add_request("victim", victim, greedy(N), priority=1)
    engine.step()  # step A: both prompts
    engine.add_request("head", other, greedy(N), priority=0)
    done: dict = {}
    engine.step()  # step B: lo0 and the victim decode; the head preempts the victim
    assert engine.scheduler.requests["victim"].status == RequestStatus.PREEMPTED
    step_until_done(engine, done)
    extended = victim + done["victim"].outputs[0].token_ids[:1] + extra
    engine.add_request("extended", extended, greedy(N))
    step_until_done(engine, done)
    prompts = {"lo0": lo0, "victim": victim, "head": other, "extended": extended}
    wrong = [rid for rid, prompt in prompts.items()
             if not matches(random_llama_hf, prompt, done[rid])]
    assert wrong == []
    assert done["extended"].num_cached_tokens == 8  # blocks 0-1, written by the recompute
    assert_no_leaks(engine)


# ---- the same at the scheduler / KV-manager level (no model) ----------------------------------

def make_scheduler(max_seqs: int = 2, num_blocks: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16, max_model_len=256)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4))


def make_req(rid: str, tokens: list[int], t: float, priority: int) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), max_tokens=8, arrival_time=t,
                   priority=priority)


def run(s: Scheduler) -> dict[str, int]:
    return {sr.request.request_id: sr.num_new_tokens for sr in scheduler_step(s).scheduled}


def hashed_free_blocks(s: Scheduler) -> set[int]:
    """Ids of the blocks in the free queue that still carry a prefix-cache hash."""
    return {b.block_id for b in s.kv_cache.pool._free.values() if b.block_hash is not None}


def test_scheduler_drops_the_victims_step_hashes_and_keeps_same_step_sharing() -> None:
    s = make_scheduler()
    victim_tokens = list(range(100, 124))
    s.add_request(make_req("lo0", range(4), 0.0, 1))
    s.add_request(make_req("victim", victim_tokens, 1.0, 1))
    assert run(s) == {"lo0": 4, "victim": 12}
    written = {b.block_id for b in s.kv_cache.pool.blocks if b.block_hash is not None}
    assert len(written) == 4  # lo0's block 0, the victim's blocks 0-2
    # The head shares the victim's first 20 tokens: blocks 0-2 (written) are hits, blocks
    # 3-4 (hashed for this step by the victim it is about to preempt) are not.
    head = make_req("head", victim_tokens[:20] + [1, 2, 3], 2.0, 0)
    s.add_request(head)
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["victim"]
    assert {sr.request.request_id: sr.num_new_tokens for sr in out.scheduled} == {
        "lo0": 1, "head": 11}
    assert head.num_computed_tokens == 12
    # Of the victim's freed blocks, only those written in step A keep their hash.
    assert hashed_free_blocks(s) <= written
    # Equal priorities still share blocks hashed in the same step (one system prompt, a
    # burst of requests): the second request hits the first's blocks at once.
    s2 = make_scheduler(max_seqs=4)
    s2.add_request(make_req("a", range(200, 213), 0.0, 0))
    s2.add_request(make_req("b", range(200, 213), 1.0, 0))
    assert run(s2) == {"a": 13, "b": 1}


def test_draft_slots_are_never_hashed() -> None:
    """Slots for speculative drafts (past the request's final tokens) are never cache
    entries, whether the scheduler or the draft proposer allocates them."""
    kv = KVCacheManager(16, 4)
    tokens = list(range(50, 59))  # 9 final tokens; 3 drafts follow
    assert kv.allocate_slots("a", tokens, 12)
    blocks = kv.req_to_blocks["a"]
    assert len(blocks) == 3 and [b.block_hash is not None for b in blocks] == [True, True, False]
    # The draft proposer offers only the computed prefix (7 of 9 computed here).
    kv2 = KVCacheManager(16, 4)
    assert kv2.allocate_slots("a", tokens[:7], 12, num_computed_tokens=7)
    assert [b.block_hash is not None for b in kv2.req_to_blocks["a"]] == [True, False, False]


def test_a_windowed_lookup_skips_excluded_blocks_and_unhashing_forgets_them() -> None:
    """Sliding window 6, 4-token blocks: "a" computed 16 tokens in an earlier step (blocks 0-1
    released behind the window since), and this step hashed blocks 4-5. A lookup excluding
    "a" stops at 16 tokens (needing only blocks 2-3); once "a" is taken out of the step, blocks
    4-5 are gone from the cache and go back to the pool first."""
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    prompt = list(range(300, 325))
    kv.begin_step()
    assert kv.allocate_slots("a", prompt, 16)
    kv.begin_step()
    assert kv.allocate_slots("a", prompt, 25, num_computed_tokens=16)
    a_blocks = list(kv.req_to_blocks["a"])
    assert len(kv.get_computed_blocks("b", prompt)) == 6
    hits = kv.get_computed_blocks("b", prompt, exclude=["a"])
    assert [b.block_id for b in hits] == [NULL_BLOCK, NULL_BLOCK] + [
        b.block_id for b in a_blocks[2:4]]
    kv.unhash_step_blocks("a")
    kv.free("a")
    assert all(b.block_hash is None for b in a_blocks[4:])
    assert len(kv.get_computed_blocks("c", prompt)) == 4
    assert [b.block_id for b in kv.pool.get_new_blocks(3)] == [b.block_id for b in a_blocks[4:]]
