"""Scheduler review: invariants of every step under random load (seeded, pure Python).

Random prompts (some sharing prefixes), priorities, drafts, aborts in every state (waiting,
running, preempted) and tight pools, driven like the engine drives the scheduler. Every
step: the budget and max_num_seqs hold, scheduled requests have slots for their tokens,
waiting requests hold no blocks, reference counts match the block tables, and without
chunked prefill a request runs all its tokens at once. At the end every request finished
(no hang) and every block is back in the pool.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import HybridKVCacheManager, KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler

NUM_REQUESTS = 30


def _check_blocks(s: Scheduler) -> None:
    kv = s.kv_cache
    pool = kv.pool
    refs: Counter[int] = Counter()
    for table in getattr(kv, "tables", [kv]):
        for rid, blocks in table.req_to_blocks.items():
            assert rid in s.requests, f"{rid} finished but still holds a block table"
            req = s.requests[rid]
            assert req in s.running or not blocks, f"{req} holds blocks outside running"
            refs.update(b.block_id for b in blocks if b is not pool.null_block)
    for b in pool.blocks:
        if b is not pool.null_block:
            assert b.ref_cnt == refs[b.block_id], b
            assert (b.ref_cnt == 0) == (b.block_id in pool._free), b


def _scheduler(rng: random.Random, chunked: bool, layout: str) -> Scheduler:
    bs = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([16, 32, 64])
    budget = rng.choice([4, 8, 16, 64]) if chunked else max_model_len + rng.choice([0, 8, 64])
    per_seq = -(-max_model_len // bs)  # the engine refuses a request needing more
    num_blocks = rng.randint(per_seq, 3 * per_seq)
    caching = rng.random() < 0.8
    cfg = SchedulerConfig(max_num_seqs=rng.choice([1, 2, 3, 8]), max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=rng.choice([None, None, 1, 3, 8]))
    if layout == "hybrid":
        kv = HybridKVCacheManager(2 * num_blocks + 1, bs, caching, [None, rng.choice([4, 8])])
    elif layout == "window":
        kv = KVCacheManager(num_blocks + 1, bs, caching, sliding_window=rng.choice([4, 8, 16]))
    else:
        kv = KVCacheManager(num_blocks, bs, caching)
    return Scheduler(cfg, kv)


def _run(seed: int, chunked: bool, layout: str) -> None:
    rng = random.Random(seed)
    s = _scheduler(rng, chunked, layout)
    cfg, bs = s.config, s.kv_cache.block_size
    max_len = cfg.max_model_len
    speculate = rng.random() < 0.5
    live: list[Request] = []
    added, t, idle = 0, 0.0, 0
    for _ in range(3000):
        if added < NUM_REQUESTS and rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                n = rng.randint(1, max_len - 1)
                max_tokens = rng.randint(1, max_len - n)
                family = rng.randint(0, 2)  # shared prefixes: prefix-cache hits
                t += 1.0
                r = Request(f"r{added}", [family * 1000 + i for i in range(n)],
                            SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                            arrival_time=t, priority=rng.choice([0, 0, 1, 2]))
                added += 1
                s.add_request(r)
                live.append(r)
        if live and rng.random() < 0.05:  # abort, whatever its state
            r = rng.choice(live)
            s.finish_request(r, RequestStatus.FINISHED_ABORTED)
            live.remove(r)
        for r in s.running:
            r.spec_token_ids = []
            if speculate and r.num_computed_tokens == r.num_tokens - 1:
                k = min(rng.randint(0, 4), r.max_tokens - r.num_output_tokens - 1,
                        max_len - r.num_tokens - 1)
                r.spec_token_ids = [5] * max(k, 0)
        preemptions = s.num_preemptions
        out = s.schedule()

        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert s.num_preemptions - preemptions == len(out.preempted)
        ids = [sr.request.request_id for sr in out.scheduled]
        assert len(ids) == len(set(ids))
        for sr in out.scheduled:
            r = sr.request
            assert r.status == RequestStatus.RUNNING and r in s.running
            assert sr.num_new_tokens >= 1 and sr.num_spec_tokens <= len(r.spec_token_ids)
            num_final = r.num_computed_tokens + sr.num_new_tokens - sr.num_spec_tokens
            assert num_final <= r.num_tokens
            assert not sr.num_spec_tokens or num_final == r.num_tokens
            if not chunked:
                assert num_final == r.num_tokens, (r, sr)
            elif cfg.long_prefill_token_threshold is not None:
                assert sr.num_new_tokens - sr.num_spec_tokens <= cfg.long_prefill_token_threshold
            held = len(s.kv_cache.req_to_blocks.get(r.request_id, ()))
            assert held * bs >= r.num_computed_tokens + sr.num_new_tokens, (r, sr)
        for r in s.waiting:
            assert r.num_computed_tokens == 0 and not s.kv_cache.req_to_blocks.get(r.request_id)
        assert s.waiting == sorted(s.waiting, key=lambda r: r.sort_key)
        assert s.running == sorted(s.running, key=lambda r: r.sort_key)
        _check_blocks(s)
        idle = 0 if out.scheduled or not s.has_unfinished_requests() else idle + 1
        assert idle < 5 or added < NUM_REQUESTS, f"stuck: {s.waiting} {s.running}"

        for sr in out.scheduled:  # advance like the engine (spec_decode/decoder.py verify)
            r = sr.request
            if sr.num_spec_tokens:
                accepted = rng.randint(0, sr.num_spec_tokens)
                r.num_computed_tokens += 1 + accepted
                s.kv_cache.truncate(r.request_id, r.num_computed_tokens)
                new = r.spec_token_ids[:accepted] + [9]
            else:
                done = sr.completes_sequence
                r.num_computed_tokens += sr.num_new_tokens
                new = [9] if done else []
            for token in new:
                r.token_ids.append(token)
                if r.num_output_tokens >= r.max_tokens or r.num_tokens >= max_len:
                    s.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    live.remove(r)
                    break
        _check_blocks(s)
        if added >= NUM_REQUESTS and not s.has_unfinished_requests():
            break
    else:
        pytest.fail(f"not done after 3000 steps: {s.waiting} {s.running}")
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    assert not s.kv_cache.req_to_blocks and not s.requests


@pytest.mark.parametrize("layout", ["full", "window", "hybrid"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_scheduler_invariants_under_random_load(chunked: bool, layout: str) -> None:
    for seed in range(40):
        _run(seed, chunked, layout)
