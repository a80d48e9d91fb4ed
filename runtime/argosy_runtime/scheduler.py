"""Continuous batching: each step decides which requests run and how many tokens each.

Every step serves running requests first (decodes, and the next chunk of partially prefilled
prompts), then admits waiting requests while the token budget, `max_num_seqs` and free KV
blocks allow. A long prompt is split into chunks (chunked prefill) so it never stalls the
running decodes; `long_prefill_token_threshold` caps one request's chunk further, so that a
long prompt shares each step's budget with the prompts behind it (vLLM's option). Both queues are ordered by `Request.sort_key`: lower `priority` value first,
then arrival.

Preemption frees a running request's blocks; it goes back to waiting and is recomputed later
(prefix caching makes that cheap). The victim is always the lowest-ranked running request
(highest priority value, then newest), in two cases:
- a running request needs blocks that are not free (memory): that step admits nothing new.
  Its speculative draft tokens are dropped first (the step verifies none of them), then those
  of the requests scheduled before it in this step (their slots given back): a draft is a
  bet on future tokens, never worth another request's recomputation;
- the head of the waiting queue cannot be admitted (`max_num_seqs` reached, blocks short, or
  without chunked prefill the step's token budget short) and it strictly outranks the victim
  by priority. Equal priorities never preempt each other, so first come first served within a
  priority never thrashes; and nobody is preempted for a head that would still not fit (seats,
  blocks, and without chunked prefill the budget) after every request it outranks was
  preempted. Short of blocks, it takes those of the drafts scheduled in step 1 before it
  preempts anyone for them.

Drafts dropped so are the ones that took blocks past their request's final tokens, lowest
rank first; drafts inside a request's last block cost nobody and stay.

`max_loras` caps the distinct LoRA adapters among running requests, so every step runs at
most that many adapters' deltas. A waiting request whose adapter would exceed it is passed
over: it keeps its place in line and is admitted once a running adapter's requests have all
finished (the earliest such request first), while requests behind it on the base model (which
never counts) or on an adapter already running may be admitted. It never preempts anyone and
never makes anyone preempt for it.

The prefix cache learns a step's full blocks when it is scheduled (so requests admitted in the
same step share them). A victim scheduled in this step's running phase never runs its tokens:
`_preempt` drops the hashes it gave in this step before freeing its blocks. And a waiting
request takes no hit on a block hashed in this step by a running request it outranks: that
request may still be preempted in this step (by it, or by a later admission, which ranks no
higher), while a request it does not outrank cannot be (waiting requests are admitted in rank
order and only preempt requests they outrank). Equal priorities keep sharing.

On a block table of sliding-window layers (every layer of a Mistral; the windowed tables of a
hybrid layout, kv_cache/layout.py), `allocate_slots` first releases the blocks behind the
window of the step's first query (kv_cache/sliding_window.py), and `can_allocate` counts them
as free: there a long request needs about the window plus its chunk, not its whole context,
to be admitted or to keep running. The scheduler is the same for either manager
(KVCacheManager, HybridKVCacheManager): it only passes their prefix hits back to them.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from argosy_runtime.config import SchedulerConfig
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.kv_cache.block_pool import KVCacheBlock
from argosy_runtime.pooling_params import WHOLE_PROMPT_POOLINGS
from argosy_runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step, draft tokens included
    num_spec_tokens: int = 0  # trailing draft tokens among them

    @property
    def completes_sequence(self) -> bool:
        """True when this step reaches the end of the known tokens, so it samples a token."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted): its blocks go back to the pool."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_by_priority(self) -> dict[int, int]:
        return dict(collections.Counter(r.priority for r in self.waiting))

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv_cache.begin_step()
        budget = self.config.max_num_batched_tokens
        preempted_for_memory = False

        # 1. Running requests, highest priority first. Victims for preemption come from the
        #    back of the list, which holds requests not yet scheduled this step.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_spec = len(req.spec_token_ids)
            num_new = req.num_tokens + num_spec - req.num_computed_tokens
            if num_new - num_spec > self._chunk_cap:  # a long prompt's next chunk
                num_new, num_spec = self._chunk_cap, 0
            if num_new > budget:
                num_spec = max(0, num_spec - (num_new - budget))
                num_new = req.num_tokens + num_spec - req.num_computed_tokens
                num_new = min(num_new, budget)
            if not self.config.enable_chunked_prefill and num_new < req.num_tokens - req.num_computed_tokens:
                i += 1
                continue
            # num_computed_tokens: final tokens (drafts come after), so a sliding-window
            # model's blocks behind the window are released without risk of a rollback.
            while not self.kv_cache.allocate_slots(
                req.request_id, req.token_ids, req.num_computed_tokens + num_new,
                salt=req.cache_salt, num_computed_tokens=req.num_computed_tokens,
            ):
                if num_spec:  # drafts are a bet, not owed: drop them before preempting anyone
                    num_new -= num_spec
                    num_spec = 0
                    continue
                # Nor are the drafts of requests scheduled before it: their slots come back
                # first (lowest rank first), so no request loses its work to another's bet.
                reclaimed = self._drop_scheduled_drafts(out)
                if reclaimed:
                    budget += reclaimed
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                preempted_for_memory = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, num_spec))
                budget -= num_new
                i += 1
                continue
            break  # the current request itself was preempted: nothing after it can run

        # 2. Waiting requests, unless step 1 had to preempt (memory is tight). A head that
        #    cannot be admitted may take the place of a running request of lower priority.
        #    Requests held by max_loras are passed over in place: the head is the first
        #    waiting request not held.
        loras = self._running_loras()
        i = 0
        while i < len(self.waiting) and budget > 0 and not preempted_for_memory:
            req = self.waiting[i]
            if loras is not None and self._held_by_max_loras(req, loras):
                i += 1
                continue
            num_preempted = len(out.preempted)
            seats_full = len(self.running) >= self.config.max_num_seqs
            if seats_full and not self._outranks_a_running_request(req):
                break
            # Not blocks hashed in this step by requests it outranks (see the module doc).
            outranked = [r.request_id for r in self.running if r.priority > req.priority]
            lookup_limit = _prefix_lookup_limit(req)
            computed = self.kv_cache.get_computed_blocks(req.request_id, req.token_ids,
                                                         lookup_limit,
                                                         salt=req.cache_salt, exclude=outranked)
            num_computed = len(computed) * self.kv_cache.block_size
            remaining = req.num_tokens - num_computed
            # Without chunked prefill the whole rest runs in this step, or the head waits.
            whole = not self.config.enable_chunked_prefill
            num_new = min(remaining, budget, self._chunk_cap)
            budget_short = whole and num_new < remaining
            if (seats_full or budget_short or not self.kv_cache.can_allocate(
                    req.request_id, num_computed + num_new, computed,
                    num_computed_tokens=num_computed)) \
                    and not self._preemption_makes_room(
                        req, num_computed + (remaining if whole else num_new), computed, out):
                break  # preempting would cost its victims their work and still not admit it
            if seats_full:
                self._preempt_for(req, out)
            if whole:
                # Victims scheduled in step 1 give their tokens back; preempting every request
                # it outranks gives enough (_preemption_makes_room): lowest rank first, only
                # as many as it takes.
                num_new = min(remaining, self._budget_left(out))
                while num_new < remaining and self._preempt_for(req, out):
                    num_new = min(remaining, self._budget_left(out))
                if num_new < remaining:
                    break
            elif seats_full:
                # The seat's victim gave back its step-1 tokens: a longer chunk, but only on
                # blocks free now. Those checked above were for `num_new`: more could cost
                # another victim its work for a token or so of this chunk, or find nobody.
                grown = min(remaining, self._budget_left(out), self._chunk_cap)
                if self.kv_cache.can_allocate(req.request_id, num_computed + grown, computed,
                                              num_computed_tokens=num_computed):
                    num_new = grown
            while not self.kv_cache.allocate_slots(
                req.request_id, req.token_ids, num_computed + num_new, computed,
                salt=req.cache_salt, num_computed_tokens=num_computed,
            ):
                if self._drop_scheduled_drafts(out):
                    continue  # step 1's drafts are a bet: their blocks go before anyone's work
                if not self._preempt_for(req, out):
                    return out  # the head waits, and nothing behind it may pass it
            # Victims went back to waiting behind `req` (they rank lower), so `i` is still it.
            self.waiting.pop(i)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:  # first admission only: a preempted request's
                # re-lookup mostly finds its own blocks, and that is recomputation, not reuse
                # (the counters agree with the requests' num_cached_tokens, as in vLLM)
                req.num_cached_tokens = num_computed
                if lookup_limit is None or lookup_limit > 0:
                    # one that may not read the cache (scoring every prompt token, whole-
                    # prompt pooling) asks it nothing: no misses counted, as in vLLM
                    self.kv_cache.record_prefix_lookup(req.num_tokens, num_computed)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget = self._budget_left(out)
            if loras is not None:
                if len(out.preempted) != num_preempted:  # victims may have taken adapters out
                    loras = self._running_loras()
                elif req.lora is not None:
                    loras.add(id(req.lora))
        return out

    @property
    def _chunk_cap(self) -> int:
        """The most prompt tokens one request prefills in a step: `long_prefill_token_threshold`
        with chunked prefill (so one long prompt leaves room for the prompts behind it),
        else no cap (the budget caps a chunk; without chunked prefill a prompt runs whole)."""
        threshold = self.config.long_prefill_token_threshold
        if threshold is None or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        return threshold

    def _running_loras(self) -> set[int] | None:
        """The distinct adapters (by object: a name loaded again is another adapter, as in
        the runner's LoRABatch) among running requests; None when max_loras is unset.

        All running requests count, not only those scheduled this step: one left out of
        this step (its chunk did not fit) runs in a later one beside whoever is admitted now.
        """
        if self.config.max_loras is None:
            return None
        return {id(r.lora) for r in self.running if r.lora is not None}

    def _held_by_max_loras(self, req: Request, loras: set[int]) -> bool:
        """Would admitting `req` add an adapter beyond max_loras? Base-model requests never."""
        if req.lora is None or id(req.lora) in loras:
            return False
        return len(loras) >= (self.config.max_loras or 0)

    def _outranks_a_running_request(self, req: Request) -> bool:
        return bool(self.running) and self.running[-1].priority > req.priority

    def _preemption_makes_room(self, req: Request, num_tokens: int,
                               computed: Sequence[KVCacheBlock], out: SchedulerOutput) -> bool:
        """Would preempting every running request that `req` outranks free a seat and the
        blocks for its first `num_tokens` tokens (and, without chunked prefill, the budget
        for all of them: victims scheduled in step 1 give their tokens back)? If not,
        nobody is preempted for it."""
        victims = [r.request_id for r in self.running if r.priority > req.priority]
        if len(self.running) - len(victims) >= self.config.max_num_seqs:
            return False
        num_computed = len(computed) * self.kv_cache.block_size
        if not self.config.enable_chunked_prefill:
            given_back = sum(sr.num_new_tokens for sr in out.scheduled
                             if sr.request.request_id in victims)
            if self._budget_left(out) + given_back < num_tokens - num_computed:
                return False
        freed = self.kv_cache.num_blocks_freed_by(victims, keep=computed)
        return self.kv_cache.can_allocate(req.request_id, num_tokens, computed, extra_free=freed,
                                          num_computed_tokens=num_computed)

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> bool:
        """Preempt the lowest-ranked running request to make room for waiting `req`, only if
        `req` has a strictly lower priority value. Returns False when there is no such victim."""
        if not self._outranks_a_running_request(req):
            return False
        victim = self.running[-1]
        self._preempt(victim)
        out.preempted.append(victim)
        # Scheduled in step 1 already: it must not run now (its slots are freed), and its
        # tokens go back to the budget (see _budget_left).
        out.scheduled = [sr for sr in out.scheduled if sr.request is not victim]
        return True

    def _drop_scheduled_drafts(self, out: SchedulerOutput) -> int:
        """Unschedule the drafts of the lowest-ranked request scheduled with drafts that took
        blocks past its final tokens, and give those blocks back (drafts inside its last
        block cost nobody: kept). Returns the draft tokens dropped (0: none)."""
        block_size = self.kv_cache.block_size
        for sr in reversed(out.scheduled):
            if not sr.num_spec_tokens:
                continue
            req = sr.request
            num_final = req.num_computed_tokens + sr.num_new_tokens - sr.num_spec_tokens
            if len(self.kv_cache.req_to_blocks.get(req.request_id, ())) <= -(-num_final
                                                                            // block_size):
                continue
            num_spec = sr.num_spec_tokens
            sr.num_new_tokens -= num_spec
            sr.num_spec_tokens = 0
            self.kv_cache.truncate(req.request_id, num_final)
            return num_spec
        return 0

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.num_batched_tokens

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        # Scheduled in this step already (a victim of _preempt_for): its blocks hashed for the
        # step will never be written. (Other victims hashed nothing in this step.)
        self.kv_cache.unhash_step_blocks(req.request_id)
        self.kv_cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)


def _prefix_lookup_limit(req: Request) -> int | None:
    """How many tokens a request may take from the prefix cache (None: all but the last).

    A cached block has no logits: prompt tokens still to be scored for `prompt_logprobs`
    must be recomputed. Scoring prompt token p needs the hidden state of token p - 1, so a
    request holding scores up to position L - 1 may reuse at most L - 1 tokens (none at
    first; after a preemption, the part it already scored). Mean pooling (and the other
    WHOLE_PROMPT_POOLINGS) for an embedding needs every position's hidden state: none.
    """
    if req.pooling is not None and req.pooling.pooling in WHOLE_PROMPT_POOLINGS:
        return 0
    scored = req.prompt_logprobs
    if scored is None or len(scored) >= req.num_prompt_tokens:
        return None
    return min(req.num_tokens - 1, len(scored) - 1)
