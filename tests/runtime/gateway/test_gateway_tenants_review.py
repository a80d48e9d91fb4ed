"""Tenants review: metering and limits at edges the other tenant tests leave out."""

from __future__ import annotations

import json

from argosy_runtime.gateway.tenants.usage import Usage, UsageMeter


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def test_continuous_usage_of_n_choices_cut_short_charges_every_choice() -> None:
    # `stream_options: {include_usage, continuous_usage_stats}` (vLLM's, the runtime's): each
    # chunk's usage counts its own choice so far. A stream of n=2 cut short before its final
    # usage chunk (client gone, replica broken) used both choices' tokens, not the last one's.
    events = [{"choices": [{"index": c, "delta": {"content": "x"}}], "usage": usage(7, k)}
              for k in (1, 2, 3) for c in (0, 1)]
    meter = UsageMeter(28, streamed=True, status=200)
    meter.feed(sse(*events))
    assert meter.result() == Usage(7, 6)
    # Whole, the final usage chunk (no choices) is the answer's total, and it is what counts.
    meter.feed(sse({"choices": [], "usage": usage(7, 8)}))
    assert meter.result() == Usage(7, 8)
