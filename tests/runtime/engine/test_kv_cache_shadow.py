"""Scheduler + KV cache manager against a shadow KV cache, on random workloads.

No model: each step "writes" every scheduled token's identity (its cache salt and the whole
token prefix up to it) into the slot its block table maps it to, then checks that every key
each new query attends to (all earlier positions; on a windowed table only the window) reads
the identity it should. A prefix-cache hit on the wrong tokens, another tenant's or adapter's
block, a block reused while still referenced, a block released behind the window too early,
or a hit on blocks whose K/V were never written all read a wrong identity. After every step
the pool's bookkeeping is checked (reference counts equal the table entries holding each
block, the free queue is exactly the unreferenced blocks, the hash index matches the blocks),
and at the end every block is free.
"""

from __future__ import annotations

import random

import pytest
from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import HybridKVCacheManager, KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler


def check_pool(kv: KVCacheManager | HybridKVCacheManager) -> None:
    pool = kv.pool
    tables = kv.tables if isinstance(kv, HybridKVCacheManager) else [kv]
    refs = {b.block_id: 0 for b in pool.blocks}
    for t in tables:
        for blocks in t.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
    for b in pool.blocks:
        if b is pool.null_block:
            assert b.ref_cnt == 0 and b.block_hash is None and b.block_id not in pool._free
            continue
        assert b.ref_cnt == refs[b.block_id], b
        assert (b.block_id in pool._free) == (b.ref_cnt == 0), b
        if b.block_hash is not None:
            assert pool._cached[b.block_hash] is b
    assert all(b.block_hash == h for h, b in pool._cached.items())


class Shadow:
    """What each slot of the pool holds: (table, block, offset) -> (salt, token prefix)."""

    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, windows: list) -> None:
        self.kv, self.windows, self.slots = kv, windows, {}

    def tables_of(self, rid: str) -> list[list[int]]:
        ids = self.kv.block_ids(rid)
        return ids if isinstance(self.kv, HybridKVCacheManager) else [ids]

    def run_step(self, scheduled) -> None:  # noqa: ANN001
        bs = self.kv.block_size
        null = self.kv.pool.null_block

        def positions(sr):  # noqa: ANN001, ANN202
            start = sr.request.num_computed_tokens
            return range(start, start + sr.num_new_tokens)

        def identity(sr, pos: int) -> tuple:  # noqa: ANN001
            req = sr.request  # final tokens, then the step's drafts
            tokens = req.token_ids + req.spec_token_ids[: sr.num_spec_tokens]
            return req.cache_salt, tuple(tokens[: pos + 1])

        # Every layer writes the whole step's K/V before attention reads (as the model does).
        for sr in scheduled:
            for table in self.tables_of(sr.request.request_id):
                for pos in positions(sr):
                    block = table[pos // bs]
                    assert null is None or block != null.block_id, (sr.request.request_id, pos)
                    self.slots[(block, pos % bs)] = identity(sr, pos)
        for sr in scheduled:
            for t, table in enumerate(self.tables_of(sr.request.request_id)):
                window = self.windows[t]
                for q in positions(sr):
                    first = 0 if window is None else max(0, q - window + 1)
                    for k in range(first, q + 1):
                        got = self.slots.get((table[k // bs], k % bs))
                        assert got == identity(sr, k), (sr.request.request_id, t, q, k)


def make_request(rid: str, prompt: list[int], salt: str | None, priority: int,
                 max_tokens: int, arrival: float) -> Request:
    params = SamplingParams(max_tokens=max_tokens, cache_salt=salt)
    return Request(rid, prompt, params, max_tokens, arrival_time=arrival, priority=priority)


def next_token(req: Request) -> int:
    """The next token depends on the sequence only, as a greedy model's would."""
    return hash(tuple(req.token_ids)) % 7


def run_workload(seed: int, windows: list, caching: bool, drafts: bool) -> None:
    """One random workload (seeded): requests sharing prefixes, on two tenants' salts, two
    priorities, arriving over a few steps, some aborted; a pool, token budget and seats small
    enough to preempt and chunk; `drafts`: decodes carry up to 3 speculative tokens, rolled
    back past the first wrong one (`truncate`)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    if len(windows) > 1:
        kv = HybridKVCacheManager(rng.randint(12, 50) + 1, bs, caching, windows)
    else:
        kv = KVCacheManager(rng.randint(8, 40) + (windows[0] is not None), bs, caching, windows[0])
    budget = rng.choice([3, 5, 8, 64])
    chunked = budget < 64 or rng.random() < 0.5
    s = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=budget,
                                  max_model_len=64, enable_chunked_prefill=chunked), kv)
    shadow = Shadow(kv, windows)
    bases = [[rng.randrange(100) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    pending = []
    for i in range(rng.randint(4, 10)):
        prompt = rng.choice(bases)[: rng.randint(0, 30)] + [rng.randrange(100)
                                                           for _ in range(rng.randint(1, 6))]
        max_tokens = rng.randint(1, 6)
        if kv.max_blocks_held(len(prompt) + max_tokens, budget if chunked else 64) > kv.num_blocks:
            continue
        req = make_request(f"r{i}", prompt, rng.choice([None, None, "a", "b"]),
                           rng.choice([0, 0, 1]), max_tokens, float(i))
        pending.append((rng.randint(0, 6), rng.choice([None, None, rng.randint(1, 12)]), req))
    aborts: dict[str, int] = {}  # request id -> the step it is aborted after
    step = 0
    while pending or s.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            s.add_request(item[2])
        if drafts:  # up to 3 drafts for decodes, some of them right
            for req in s.running:
                if req.num_computed_tokens == req.num_tokens - 1:
                    req.spec_token_ids = [rng.randrange(7) for _ in range(rng.randint(0, 3))]
        out = s.schedule()
        shadow.run_step(out.scheduled)
        for sr in out.scheduled:
            req = sr.request
            done = sr.completes_sequence
            if sr.num_spec_tokens:  # accept drafts while they equal the "model's" tokens
                for draft in req.spec_token_ids[: sr.num_spec_tokens] + [None]:
                    req.num_computed_tokens += 1
                    req.token_ids.append(next_token(req))
                    if req.token_ids[-1] != draft:
                        break
                req.spec_token_ids = []
                kv.truncate(req.request_id, req.num_computed_tokens)
            else:
                req.num_computed_tokens += sr.num_new_tokens
                req.spec_token_ids = []
                if done:
                    req.token_ids.append(next_token(req))
            if done and req.num_output_tokens >= req.max_tokens:
                s.finish_request(req, RequestStatus.FINISHED_LENGTH)
        step += 1
        for arrive, abort, req in list(pending):
            if arrive < step:
                pending.remove((arrive, abort, req))
                if abort is not None:
                    aborts[req.request_id] = step + abort
        for rid, at in list(aborts.items()):
            if at == step and rid in s.requests:
                s.finish_request(s.requests[rid], RequestStatus.FINISHED_ABORTED)
        check_pool(kv)
        assert step < 500, "no progress"
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.req_to_blocks == {}


@pytest.mark.parametrize("windows", [[None], [5], [None, 6], [None, 3, 3]],
                         ids=["full", "window", "hybrid", "hybrid3"])
@pytest.mark.parametrize(("caching", "drafts"), [(True, False), (True, True), (False, True)],
                         ids=["cached", "cached-drafts", "uncached-drafts"])
def test_random_workloads_read_only_their_own_kv(windows: list, caching: bool,
                                                 drafts: bool) -> None:
    for seed in range(150):
        run_workload(seed, windows, caching, drafts)
