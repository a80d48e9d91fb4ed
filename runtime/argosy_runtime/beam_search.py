"""Beam search: the `beam_width` most probable continuations of a prompt.

The search is transformers' `generate(num_beams=..., do_sample=False)` with its defaults
(`early_stopping=False`, `length_penalty`), step for step, so the same model gives the same
beams (tests/runtime/engine/test_beam_search.py checks it against transformers). Each step:

1. every live beam's next-token log-probabilities extend it; the best K = max(2, 1 + number
   of end tokens) * beam_width extensions over all beams are the candidates (K, not
   beam_width, so that enough stay live when some end);
2. a candidate among the best beam_width that ends (an end token, or max_tokens reached) is a
   finished hypothesis, scored `cum_logprob / generated_length ** length_penalty`; the best
   beam_width hypotheses are kept;
3. the best beam_width candidates that did not end are the next live beams;
4. the search stops at max_tokens, or once beam_width hypotheses are finished and the best
   live beam, scored at its current length, is no better than the worst of them.

Like vLLM's, it runs on top of the engine rather than inside it: `BeamSearch` is the
bookkeeping, and its drivers (`LLM.beam_search`, the server's `use_beam_search`) score every
live beam as a one-token request (the prompt plus the beam's tokens) asking for the top-K
log-probabilities. The prefix cache holds the prompt and every beam's earlier full blocks, so
a step computes about one partial block per beam, not the whole sequence again.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from argosy_runtime.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names. `length_penalty` > 0 favours longer hypotheses, < 0 shorter ones (the
    exponent of the generated length that divides the summed log-probability)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    # SamplingParams.cache_salt of every scoring request (prefix-cache blocks are shared
    # with requests of the same salt only)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (not isinstance(self.length_penalty, (int, float))
                or isinstance(self.length_penalty, bool) or not math.isfinite(self.length_penalty)):
            # NaN scores every hypothesis NaN: the ranking and the stop rule mean nothing.
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):  # "false" would be truthy: the opposite
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` is the prompt and the generated tokens (vLLM's layout, an end
    token included), `text` the generated text (without the end token), `score` what beams are
    ranked by."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str  # "stop": ended with an end token; "length": reached max_tokens
    stop_reason: int | None = None  # the end token


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]  # generated so far
    cum_logprob: float


def max_beam_width(num_end_tokens: int) -> int:
    """The widest beam whose K candidates fit in one request's top log-probabilities."""
    return MAX_LOGPROBS // max(2, 1 + num_end_tokens)


class BeamSearch:
    """The search for one prompt: `requests()` are the token sequences to score next (one
    per live beam), `advance()` takes their next-token log-probabilities, until `done`."""

    def __init__(self, prompt: list[int], params: BeamSearchParams,
                 end_token_ids: Collection[int]) -> None:
        self.prompt = list(prompt)
        self.params = params
        self.end_tokens = frozenset() if params.ignore_eos else frozenset(end_token_ids)
        self.num_candidates = max(2, 1 + len(self.end_tokens)) * params.beam_width
        if self.num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width must be at most {max_beam_width(len(self.end_tokens))} for this "
                f"model ({len(self.end_tokens)} end token(s)), got {params.beam_width}")
        self.live = [_Beam((), 0.0)]
        self.finished: list[tuple[float, _Beam]] = []  # (score, beam), best first
        self.done = False

    def scoring_params(self) -> SamplingParams:
        """How each live beam is scored: one greedy token (never kept), the top-K log-probs."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=self.num_candidates, cache_salt=self.params.cache_salt)

    def requests(self) -> list[list[int]]:
        return [self.prompt + list(beam.tokens) for beam in self.live]

    def advance(self, next_logprobs: list[Mapping[int, float]]) -> None:
        """One step: `next_logprobs[i]` maps (at least) the top-K next tokens of live beam i
        to their log-probabilities."""
        if len(next_logprobs) != len(self.live):
            raise ValueError(f"got log-probs for {len(next_logprobs)} beams, "
                             f"{len(self.live)} are live")
        width, penalty = self.params.beam_width, self.params.length_penalty
        extended = [(beam.cum_logprob + logprob, i, token)
                    for i, (beam, top) in enumerate(zip(self.live, next_logprobs))
                    for token, logprob in top.items()]
        extended.sort(key=lambda c: -c[0])  # stable: ties keep beam, then token order
        candidates = [_Beam(self.live[i].tokens + (token,), cum) for cum, i, token in
                      extended[:self.num_candidates]]
        length = len(candidates[0].tokens)  # every candidate is one token longer
        at_limit = length >= self.params.max_tokens
        ends = [at_limit or beam.tokens[-1] in self.end_tokens for beam in candidates]
        # Only the best beam_width candidates may finish; the rest are spares to stay live.
        for beam, end in zip(candidates[:width], ends):
            if end:
                self.finished.append((_score(beam.cum_logprob, length, penalty), beam))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[width:]
        self.live = [beam for beam, end in zip(candidates, ends) if not end][:width]
        self.done = all(ends) or (
            len(self.finished) == width
            and _score(self.live[0].cum_logprob, length, penalty) <= self.finished[-1][0])

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """The finished hypotheses, best first (call once `done`)."""
        sequences = []
        for score, beam in self.finished:
            tokens = list(beam.tokens)
            ended = bool(tokens) and tokens[-1] in self.end_tokens
            shown = tokens[:-1] if ended else tokens
            sequences.append(BeamSearchSequence(
                tokens=self.prompt + tokens, text=tokenizer.decode(shown), cum_logprob=beam.cum_logprob,
                score=score, finish_reason="stop" if ended else "length",
                stop_reason=tokens[-1] if ended else None))
        return BeamSearchOutput(sequences)


def _score(cum_logprob: float, length: int, penalty: float) -> float:
    """cum_logprob / length ** penalty, its limit where the power leaves a float's range (a
    penalty of +-100 past ~1200 tokens: OverflowError, or a 0.0 divisor)."""
    try:
        return cum_logprob / length ** penalty
    except (OverflowError, ZeroDivisionError):
        if penalty > 0:  # divided by "infinity"
            return -0.0 if cum_logprob < 0 else 0.0
        return -math.inf if cum_logprob < 0 else 0.0


def live_requests(searches: Sequence[BeamSearch]) -> list[tuple[BeamSearch, list[int]]]:
    """One step of several searches run together: (search, tokens to score) for every live
    beam of every search not done; empty once all are."""
    return [(s, tokens) for s in searches if not s.done for tokens in s.requests()]


def advance_searches(requests: list[tuple[BeamSearch, list[int]]], outputs: Sequence[Any]) -> None:
    """Feed each search its beams' next-token log-probabilities: `outputs[i]` is the
    RequestOutput of `requests[i]` (run with `scoring_params()`)."""
    by_search: dict[int, tuple[BeamSearch, list[dict[int, float]]]] = {}
    for (search, _), out in zip(requests, outputs, strict=True):
        top = out.outputs[0].logprobs[0]
        by_search.setdefault(id(search), (search, []))[1].append(
            {t: lp.logprob for t, lp in top.items()})
    for search, next_logprobs in by_search.values():
        search.advance(next_logprobs)
