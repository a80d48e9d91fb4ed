"""`SpeculativeDecoder`: proposes draft tokens before a step and verifies them after it.

Inside continuous batching: a request with drafts is scheduled with 1 + k query tokens (its
last sampled token plus the drafts), the runner returns the target logits at those k + 1
positions, and `verify` keeps the longest valid prefix plus one target token. KV slots
written for rejected drafts are rolled back (blocks past the accepted length are released;
slots inside kept blocks are simply overwritten later). Requests without drafts, or still in
prefill, run in the same batch as usual.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from argosy_runtime.outputs import PositionLogprobs
from argosy_runtime.request import Request
from argosy_runtime.sampler import compute_logprobs
from argosy_runtime.spec_decode.config import SpeculativeConfig
from argosy_runtime.spec_decode.rejection import verify_sampled

if TYPE_CHECKING:
    from argosy_runtime.engine import LLMEngine
    from argosy_runtime.scheduler import ScheduledRequest


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] proposal distribution; None = one-hot


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]: ...


@dataclass
class _Adaptive:
    """Per-request acceptance tracking for adaptive k."""

    k: int  # drafts to ask for next step (1 .. num_speculative_tokens)
    rate: float = 1.0  # exponential moving average of accepted / proposed
    cooldown: int = 0  # steps left without speculation
    backoff: int = 8
    probing: bool = False  # first speculative step after a pause: one failure pauses again


class SpeculativeDecoder:
    def __init__(self, engine: LLMEngine, config: SpeculativeConfig, proposer: Proposer) -> None:
        # A proxy: the engine owns this object, so a strong reference back would keep a
        # dropped engine (and its KV cache) alive until the garbage collector ran.
        self.engine = weakref.proxy(engine)
        self.config = config
        self.proposer = proposer
        self._adaptive: dict[str, _Adaptive] = {}
        self._proposals: dict[str, Proposal] = {}

    def finish(self, request_id: str) -> None:
        """The request is done: what was kept for it goes (a separate draft's blocks too)."""
        self._adaptive.pop(request_id, None)
        self._proposals.pop(request_id, None)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(request_id)

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on every running decode that should speculate this step.

        Drafts are cut before the first token a structured output's grammar rejects (it
        would be rejected anyway), except when a sampled request has a draft distribution q:
        there a rejected draft's residual max(0, p - q) is what keeps the output distributed
        as p, and cutting would sample from p instead, which over-weights tokens q favours.
        (With a one-hot q, as n-gram drafts have, the residual of an invalid draft is p: cut.)
        """
        live = {r.request_id for r in running}
        for rid in list(self._adaptive):
            if rid not in live:
                del self._adaptive[rid]
        self._proposals.clear()
        for req in running:
            req.spec_token_ids = []
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return  # a large batch makes the step compute-bound: extra rows are not free
        batch: list[tuple[Request, int]] = []
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # still prefilling
            # Never propose past max_tokens / max_model_len: the step yields up to k + 1 tokens.
            k = min(self.config.num_speculative_tokens,
                    req.max_tokens - req.num_output_tokens - 1,
                    self.engine.max_model_len - req.num_tokens - 1)
            if k <= 0:
                continue
            state = self._state(req.request_id)
            if state.cooldown > 0:
                state.cooldown -= 1
                continue
            if self.config.adaptive:
                k = min(k, state.k)
            batch.append((req, k))
        if not batch:
            return
        if hasattr(self.proposer, "propose_batch"):
            proposals = self.proposer.propose_batch(batch)
        else:
            proposals = [Proposal(self.proposer.propose(r.token_ids, k)) for r, k in batch]
        for (req, _), proposal in zip(batch, proposals):
            if req.grammar is not None and (req.params.is_greedy or proposal.probs is None):
                proposal.tokens = req.grammar.valid_prefix(req.output_token_ids, proposal.tokens)
            elif req.grammar is not None:  # (its q rows are cut with its tokens in verify)
                proposal.tokens = req.grammar.cut_at_end(req.output_token_ids, proposal.tokens)
            if (proposal.probs is None and not req.params.is_greedy
                    and self.engine.jumps_forward(req)):
                proposal.tokens = _cut_before_forced(req, proposal.tokens)
            if proposal.tokens:
                req.spec_token_ids = proposal.tokens
                self._proposals[req.request_id] = proposal

    def verify(self, sr: ScheduledRequest, logits: torch.Tensor
               ) -> tuple[list[int], list[PositionLogprobs] | None]:
        """Accept a prefix of the drafts; advance the request's computed tokens; roll back KV.

        logits: float32 [num_spec + 1, vocab], the target's logits at the last token and at each
        draft. Returns the new tokens (accepted drafts + one target token) and their logprobs.
        """
        req = sr.request
        drafts = req.spec_token_ids[: sr.num_spec_tokens]
        proposal = self._proposals.get(req.request_id)
        sampler = self.engine.runner.sampler

        def processed(i: int, accepted: list[int]) -> torch.Tensor:
            # Penalties, min_tokens and the grammar see the tokens accepted before position i.
            return sampler.process_after(logits[i : i + 1], [req], [accepted])

        if req.params.is_greedy:
            accepted: list[int] = []
            for i in range(len(drafts) + 1):
                token = int(processed(i, accepted).argmax(dim=-1))
                accepted.append(token)
                if i == len(drafts) or token != drafts[i]:
                    break
        else:
            draft_probs = None
            if proposal is not None and proposal.probs is not None:
                draft_probs = proposal.probs[: len(drafts)]
            accepted = verify_sampled(
                lambda i, acc: sampler.probs(processed(i, acc), [req])[0],
                drafts, draft_probs,
                uniform=lambda: sampler.uniform(req),
                sample=lambda row: int(sampler.sample_from(row[None, :], [req])[0]),
            )

        num_accepted = len(accepted) - 1
        req.num_computed_tokens += 1 + num_accepted
        req.spec_token_ids = []
        self.engine.kv_cache.truncate(req.request_id, req.num_computed_tokens)
        stats = self.engine.stats
        stats.spec_decode_num_draft_tokens += len(drafts)
        stats.spec_decode_num_accepted_tokens += num_accepted
        self._update_adaptive(req.request_id, len(drafts), num_accepted)
        logprobs = None
        if req.logprobs is not None:
            logprobs = compute_logprobs(logits[: len(accepted), : sampler.vocab_size], accepted,
                                        req.params.logprobs or 0)
        return accepted, logprobs

    def _state(self, request_id: str) -> _Adaptive:
        state = self._adaptive.get(request_id)
        if state is None:
            state = self._adaptive[request_id] = _Adaptive(k=self.config.num_speculative_tokens)
        return state

    def _update_adaptive(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Adaptive k. A verification pass with k drafts costs more than a plain decode step
        (measured on these CPUs: 1.7x for k = 1), so speculation must earn its keep:

        - k follows the acceptance: all drafts accepted -> double k (up to the configured k);
          a rejection -> next k is the accepted length + 1. A request in a copied span ramps
          back to full k in a few steps; one in free text drafts one token at a time.
        - a request whose moving acceptance rate falls below `min_acceptance_rate` pauses for
          `backoff` steps, then probes once with k = 1: a failed probe pauses it again with a
          doubled backoff (up to 256 steps). Only a step that accepts 2+ drafts (a real copied
          span, not a lucky single token) resets the backoff.
        """
        if not self.config.adaptive:
            return
        state = self._state(request_id)
        rate = num_accepted / max(1, num_drafts)
        if num_accepted == num_drafts:
            state.k = min(self.config.num_speculative_tokens, 2 * state.k)
        else:
            state.k = max(1, num_accepted + 1)
        state.rate = 0.6 * state.rate + 0.4 * rate
        probing, state.probing = state.probing, False
        if (probing and num_accepted == 0) or state.rate < self.config.min_acceptance_rate:
            state.cooldown = state.backoff
            state.backoff = min(state.backoff * 2, 256)
            state.k = 1
            state.probing = True
        elif num_accepted >= 2:
            state.backoff = 8


def _cut_before_forced(req: Request, drafts: list[int]) -> list[int]:
    """One-hot drafts of a sampled request that jumps forward, cut so that verification
    draws at no position plain decoding fills by jump-forward. Plain decoding draws one
    token, then appends the tokens the grammar forces after it without a draw; verification
    draws at every draft position and the bonus one. A draw at a forced position would use
    up the request's random draws out of step with plain decoding, and a seeded request's
    later tokens would differ with speculation on (docs/speculative.md promises the same
    tokens). So the last draw (the bonus position) must be the one after which tokens are
    forced: keep drafts[:j - 1] for the first j where drafts[:j] leave tokens forced."""
    output = req.output_token_ids
    for j in range(1, len(drafts) + 1):
        if req.grammar.forced_tokens(output + drafts[:j]):
            return drafts[: j - 1]
    return drafts
