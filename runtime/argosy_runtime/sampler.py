"""Token sampling for a whole batch at once.

Order per row: min_tokens masking, logit_bias, penalties (repetition, frequency, presence;
vLLM's and transformers' order: the repetition penalty scales the biased logit), the
request's token masks (allowed_token_ids, bad_words) and the structured-output grammar's
mask on the raw logits, then greedy argmax, or temperature -> top-k -> top-p -> min-p ->
sample. (The masks set -inf, which no penalty or bias undoes, so their place in the order does
not matter; vLLM applies them first.) Sampling uses
the exponential-race trick (argmax of p / Exp(1) noise), so rows with their own seeded
generator and rows on the shared generator go through the same code.
Logprobs are those of the raw model distribution (before penalties, biases, masks and
temperature), as vLLM reports them by default (`logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

import torch

from argosy_runtime.bad_words import banned_next_tokens
from argosy_runtime.outputs import Logprob, PositionLogprobs
from argosy_runtime.request import Request


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator | None = None) -> None:
        self.vocab_size = vocab_size
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row. logits: float32 [num_rows, vocab] (may exceed the vocab)."""
        logits = self.process(logits, requests)
        greedy = [r.params.is_greedy for r in requests]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        return self._sample(logits, requests, greedy).tolist()

    # ---- logits processing ----------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        needs = [
            r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0
            or r.params.frequency_penalty != 0.0
            for r in requests
        ]
        if not any(needs):
            return logits
        logits = logits.clone()
        rows = [i for i, n in enumerate(needs) if n]
        vocab = logits.shape[1]
        for i in rows:  # penalties are rare; a per-row loop keeps this simple and exact
            p = requests[i].params
            out_ids = torch.tensor(requests[i].output_token_ids, dtype=torch.long)
            out_ids = out_ids[out_ids < vocab]
            counts = torch.zeros(vocab, dtype=logits.dtype)
            counts.scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool)
                ids = torch.tensor(requests[i].token_ids, dtype=torch.long)
                seen[ids[ids < vocab]] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalized, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
            logits[i] = row
        return logits

    def _mask_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            req = requests[i]
            p = req.params
            stop_ids = [t for t in (set(p.stop_token_ids) | p.all_stop_token_ids) if t < logits.shape[1]]
            if stop_ids and not _grammar_allows_only(req, stop_ids):
                logits[i, stop_ids] = float("-inf")
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.params.logit_bias]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            bias = requests[i].params.logit_bias
            ids = torch.tensor(list(bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
        return logits

    def _mask_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """-inf for every token outside a request's allowed_token_ids, and for every token
        that would complete one of its bad words after the tokens generated so far."""
        rows = [i for i, r in enumerate(requests)
                if r.params.allowed_token_ids or r.params.bad_words_token_ids]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            req = requests[i]
            if req.params.allowed_token_ids:
                ids = torch.tensor(req.params.allowed_token_ids, dtype=torch.long)
                kept = logits[i, ids]
                logits[i] = float("-inf")
                logits[i, ids] = kept
            banned = banned_next_tokens(req.params.bad_words_token_ids, req.token_ids,
                                        req.num_prompt_tokens)
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _mask_grammar(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """-inf for every token the request's structured-output grammar forbids next."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            req = requests[i]
            allowed = req.grammar.allowed_tokens(req.output_token_ids)
            logits[i].masked_fill_(~allowed, float("-inf"))
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        probs = self.probs(logits, requests)
        sampled = self.sample_from(probs, requests)
        if any(greedy):
            greedy_mask = torch.tensor(greedy)
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled

    def process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """min_tokens masking, logit_bias, penalties, the token masks and the grammar mask:
        the logits greedy decoding takes the argmax of (speculative verification calls this
        at every draft position, so the masks hold there too)."""
        # logit_bias before the penalties, as vLLM and transformers: the (multiplicative)
        # repetition penalty scales the biased logit. min_tokens' -inf stays -inf either way.
        logits = self._apply_logit_bias(self._mask_min_tokens(logits[:, : self.vocab_size],
                                                              requests), requests)
        logits = self._apply_penalties(logits, requests)
        return self._mask_grammar(self._mask_tokens(logits, requests), requests)

    def process_after(self, logits: torch.Tensor, requests: list[Request],
                      appended: list[list[int]]) -> torch.Tensor:
        """`process` at a speculative position: as if each request's output went on with
        `appended[i]` (drafts not verified yet), which penalties, min_tokens and the grammar
        then see. The requests' tokens are as they were on return."""
        lengths = [len(req.token_ids) for req in requests]
        try:
            for req, tokens in zip(requests, appended, strict=True):
                req.token_ids.extend(tokens)
            return self.process(logits, requests)
        finally:
            for req, length in zip(requests, lengths):
                del req.token_ids[length:]

    def probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each (non-greedy) row samples from: temperature, top-k, top-p,
        min-p applied to processed logits. Greedy rows get temperature 1 (unused)."""
        temps = torch.tensor([r.params.temperature if not r.params.is_greedy else 1.0
                              for r in requests], dtype=logits.dtype)
        scaled = logits / temps[:, None]
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        min_p = [r.params.min_p for r in requests]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        if any(m > 0 for m in min_p):
            min_p_t = torch.tensor(min_p, dtype=probs.dtype)[:, None]
            threshold = probs.max(dim=-1, keepdim=True).values * min_p_t
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return probs

    def sample_from(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row from (unnormalized) probs, each row on its request's generator
        when it has one (seeded requests are reproducible whatever else is in the batch)."""
        noise = torch.empty_like(probs)
        shared_rows = [i for i, r in enumerate(requests) if r.generator is None]
        if shared_rows:
            noise[shared_rows] = torch.empty(
                len(shared_rows), probs.shape[1], dtype=probs.dtype
            ).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, request: Request) -> float:
        """A U(0, 1) draw on the request's generator (or the shared one)."""
        gen = request.generator if request.generator is not None else self.generator
        return float(torch.rand((), generator=gen))


def compute_logprobs(raw_logits: torch.Tensor, token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Per row: the logprob and rank of `token_ids[row]` plus the top-k alternatives, from the
    raw model distribution (log_softmax of unprocessed logits)."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    tokens = torch.tensor(token_ids, dtype=torch.long)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    out: list[PositionLogprobs] = []
    for i, token in enumerate(token_ids):
        entry: PositionLogprobs = {token: Logprob(float(chosen[i]), ranks[i])}
        if k > 0:
            for rank, (tid, lp) in enumerate(zip(top_ids[i].tolist(), top_values[i].tolist()), 1):
                entry.setdefault(tid, Logprob(lp, rank))
        out.append(entry)
    return out


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); keeps at least one token."""
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.tensor([min(t, vocab) if t > 0 else vocab for t in top_k])
    # Outside top-k: strictly below the k-th largest logit, as vLLM and transformers mask.
    # Tokens tied with the k-th stay (by position, top_k=1 always took whichever of tied
    # tokens the sort put first).
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [num_rows, 1]
    mask = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    p = torch.tensor(top_p, dtype=logits.dtype)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    # Only rows that asked for a nucleus: the float32 cumsum can reach 1.0 before the last
    # tokens, and a top_p=1 row must not lose its tail because another row in the batch
    # uses top-k/top-p (its distribution, and a seeded request's tokens, would then depend
    # on the batch).
    mask = (cum_before >= p) & (p < 1.0)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _grammar_allows_only(req: Request, stop_ids: list[int]) -> bool:
    """Whether the request's structured output may only end next (complete, or a grammar
    only the empty output matches): min_tokens banning its stop tokens left no token at all,
    and the request failed instead of stopping. A complete structured output is never
    padded (docs/structured_outputs.md)."""
    if req.grammar is None:
        return False
    allowed = req.grammar.allowed_tokens(req.output_token_ids).clone()
    allowed[stop_ids] = False
    return not bool(allowed.any())
