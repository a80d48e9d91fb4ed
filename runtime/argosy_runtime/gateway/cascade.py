"""Small-to-big model cascade: easy requests to a cheap model, hard ones to a large one.

A cascade is a route name clients put in `model` (say `auto`). `decide` picks the model to ask
first from what is known before generation (header, model-name suffix, prompt length,
max_tokens, keywords). For non-streamed requests answered by the small model, `mean_logprob`
of that answer can send the request on to the large model (the answer is only as good as the
small model's confidence in it). Every decision carries a reason, counted in the gateway's
metrics and returned to the client in `x-argosy-cascade` / `x-argosy-cascade-reason`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from argosy_runtime.gateway.config import CascadeConfig
from argosy_runtime.gateway.request_text import (
    content_text,
    prompt_texts,
    requested_max_tokens,
)

# Reasons, in the order the rules are tried.
REASON_HEADER = "header"
REASON_MODEL_NAME = "model_name"
REASON_PROMPT_LENGTH = "prompt_length"
REASON_MAX_TOKENS = "max_tokens"
REASON_KEYWORD = "keyword"
REASON_DEFAULT = "default"
REASON_LOW_CONFIDENCE = "low_confidence"
REASON_CONFIDENT = "confident"
REASON_NO_LOGPROBS = "no_logprobs"
REASON_SMALL_FAILED = "small_failed"
REASON_SMALL_UNAVAILABLE = "small_unavailable"


@dataclass(frozen=True)
class CascadeDecision:
    """Which model to ask first, and why."""

    tier: str  # "small" or "large"
    model: str
    reason: str
    # Ask the small model for logprobs and escalate when its answer's mean is too low.
    check_confidence: bool = False


def split_route_name(model: str) -> tuple[str, str | None]:
    """`auto:large` -> ("auto", "large"); `auto` -> ("auto", None)."""
    base, sep, tier = model.rpartition(":")
    if sep and tier in ("small", "large"):
        return base, tier
    return model, None


def decide(
    cascade: CascadeConfig,
    path: str,
    body: dict[str, Any],
    headers: Mapping[str, str],
    forced_tier: str | None = None,
) -> CascadeDecision:
    """Apply the up-front rules. `forced_tier` comes from a `<route>:small|large` model name."""

    def large(reason: str) -> CascadeDecision:
        return CascadeDecision("large", cascade.large, reason)

    def small(reason: str) -> CascadeDecision:
        # A streamed answer is gone before it could be judged; a beam search returns no
        # logprobs (asking for them would be a 400); an echoed completion's token_logprobs
        # start with the prompt's, so their mean would judge the prompt, not the answer.
        # A client that asked for the small model (header or `:small`) gets its answer,
        # never the large model's: only the rules' own choice is checked.
        check = (cascade.min_mean_logprob is not None and reason == REASON_DEFAULT
                 and not body.get("stream", False) and not body.get("use_beam_search", False)
                 and not body.get("echo", False))
        return CascadeDecision("small", cascade.small, reason, check_confidence=check)

    header = str(headers.get(cascade.header, "")).strip().lower()
    if header in ("large", "small"):
        return large(REASON_HEADER) if header == "large" else small(REASON_HEADER)
    if forced_tier is not None:
        return large(REASON_MODEL_NAME) if forced_tier == "large" else small(REASON_MODEL_NAME)
    longest = max(len(text) for text in prompt_texts(path, body))
    if cascade.prompt_chars_over is not None and longest > cascade.prompt_chars_over:
        return large(REASON_PROMPT_LENGTH)
    max_tokens = requested_max_tokens(body)
    if (
        cascade.max_tokens_over is not None
        and max_tokens is not None
        and max_tokens > cascade.max_tokens_over
    ):
        return large(REASON_MAX_TOKENS)
    if cascade.keywords:
        # The messages' text without their roles: a keyword such as "system" or "tool" must
        # not match every conversation that has such a turn.
        lowered = content_text(path, body).lower()
        if any(k in lowered for k in cascade.keywords):
            return large(REASON_KEYWORD)
    return small(REASON_DEFAULT)


def request_logprobs(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A copy of `body` that asks for the sampled tokens' logprobs.

    Returns (body, added): `added` is True when the client had not asked for them, so the
    gateway should strip them from the answer it returns.
    """
    body = dict(body)
    if path.endswith("/chat/completions"):
        if body.get("logprobs"):
            return body, False
        body["logprobs"] = True
        return body, True
    if body.get("logprobs") is not None:
        return body, False
    body["logprobs"] = 0  # 0: only the sampled token's logprob, no alternatives
    return body, True


def mean_logprob(response: dict[str, Any]) -> float | None:
    """The mean logprob of the sampled tokens of the least confident choice; None when no
    choice has any. Every choice counts: a completions batch holds one answer per prompt (and
    `n` per prompt), and judging the first alone accepted a batch whose other answers the
    small model was unsure of.

    Reads both shapes: completions (`logprobs.token_logprobs`) and chat
    (`logprobs.content[].logprob`).
    """
    choices = response.get("choices")
    if not isinstance(choices, list):
        return None
    means = [m for c in choices if isinstance(c, dict)
             and (m := _choice_mean(c.get("logprobs"))) is not None]
    return min(means, default=None)


def _choice_mean(logprobs: Any) -> float | None:
    if not isinstance(logprobs, dict):
        return None
    values: list[float] = []
    if isinstance(logprobs.get("token_logprobs"), list):
        values = [v for v in logprobs["token_logprobs"] if isinstance(v, int | float)]
    elif isinstance(logprobs.get("content"), list):
        values = [
            e["logprob"]
            for e in logprobs["content"]
            if isinstance(e, dict) and isinstance(e.get("logprob"), int | float)
        ]
    if not values:
        return None
    return sum(values) / len(values)


def strip_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    """Remove the logprobs the gateway asked for on the client's behalf."""
    for choice in response.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None
    return response


def unavailable(upstream: object) -> bool:
    """Whether the gateway's try of a model ended without it taking the request: no replica in
    rotation (503), all of them busy (429) or failing (5xx after the retries). A replica's
    answer (any status, a 4xx included: the client's mistake is the same on the large model)
    is an `Upstream`, not a `web.Response`."""
    return isinstance(upstream, web.Response) and (
        upstream.status == 429 or upstream.status >= 500)
