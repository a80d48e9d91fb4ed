"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions.

`n` is the beam width and the n best hypotheses are the choices, best first, with
`length_penalty` (default 1.0) and `ignore_eos` as in `BeamSearchParams` (beam_search.py:
transformers' beam search, run as one-token scoring requests per step). A beam search ranks by
the model's own log-probabilities, so `temperature` and `seed` do not apply (accepted, as
vLLM does); every other option that changes the distribution or the output token by token
is a 400 naming it. With `stream` the reply comes as one chunk per choice once the search
ends (a beam is not final until then).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from argosy_runtime.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    advance_searches,
    live_requests,
)
from argosy_runtime.server.errors import APIError, bad_request
from argosy_runtime.server.owners import cache_salt_of, owner_of
from argosy_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from argosy_runtime.server.reasoning_parser import (
    count_reasoning_tokens,
    split_reasoning,
    token_ends,
)
from argosy_runtime.server.request_log import request_id_of, request_log
from argosy_runtime.server.serving_common import (
    SSE_DONE,
    ClientGone,
    ServingContext,
    admitted_at_once,
    run_to_completion,
    sse,
    start_streams,
    usage_info,
)
from argosy_runtime.server.streaming import GuardedStreamingResponse
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

# (field, its value when unset): options a beam search cannot honour.
_NOT_WITH_BEAM_SEARCH = (
    ("top_p", None), ("top_k", None), ("min_p", None), ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0), ("repetition_penalty", None), ("min_tokens", 0),
    ("stop", None), ("stop_token_ids", None), ("logit_bias", None),
    ("allowed_token_ids", None), ("bad_words", None), ("structured_outputs", None),
    ("response_format", None), ("logprobs", None), ("top_logprobs", None), ("tools", None),
    ("prompt_logprobs", None),
)
# Fields whose 0 asks for something (the sampled token's log-probability, each prompt
# token's), unlike top_k 0 or min_tokens 0; `0 in (None, False)` is true in Python (0 ==
# False), so the test above would take them as unset and drop them silently.
_ZERO_ASKS = ("logprobs", "prompt_logprobs")


def beam_search_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                       owner: str | None = None) -> BeamSearchParams:
    for field, unset in _NOT_WITH_BEAM_SEARCH:
        value = getattr(req, field, unset)
        if field in _ZERO_ASKS:
            is_set = value is not None and value is not False  # chat's logprobs is a bool
        else:
            is_set = value not in (unset, False, [], {}) and not (
                field == "response_format" and value.type == "text")
        if is_set:
            raise bad_request(f"{field} is not supported with use_beam_search", field)
    return BeamSearchParams(beam_width=req.n or 1, max_tokens=max_tokens,
                            ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                            cache_salt=cache_salt_of(owner, req.cache_salt))


async def run_beam_search(request: Request, ctx: ServingContext, base_id: str,
                          prompts: list[list[int]], params: BeamSearchParams,
                          model_name: str, priority: int) -> list[BeamSearchOutput]:
    """Every prompt's search, each step's beams of all prompts admitted together; a client
    that leaves aborts the step (ClientGone), request_timeout bounds the whole search."""
    try:
        searches = [BeamSearch(p, params, ctx.end_token_ids) for p in prompts]
    except ValueError as exc:
        raise bad_request(f"n (the beam width): {exc}", "n") from exc
    scoring = searches[0].scoring_params()
    try:
        async with asyncio.timeout(ctx.config.request_timeout or None):
            step = 0
            while requests := live_requests(searches):
                streams = await start_streams(ctx, f"{base_id}-beam{step}",
                                              [r for _, r in requests], scoring, model_name,
                                              priority)
                advance_searches(requests, await run_to_completion(request, ctx, streams))
                step += 1
    except TimeoutError:
        raise APIError(408, f"request timed out after {ctx.config.request_timeout:g}s",
                       code="request_timeout") from None
    return [s.output(ctx.tokenizer) for s in searches]


async def beam_search_response(request: Request, ctx: ServingContext,
                               req: CompletionRequest | ChatCompletionRequest,
                               model_name: str, prompts: list[list[int]], max_tokens: int,
                               prefixes: list[str] | None = None) -> Response:
    """The whole reply of a completions (`prefixes`: echoed prompts) or chat request."""
    chat = isinstance(req, ChatCompletionRequest)
    params = beam_search_params(req, max_tokens, owner_of(request))
    # Each step scores every live beam of every prompt as its own request, all admitted
    # together: more than the server admits at once would be a 429 from the second step on,
    # after work was spent, and no retry could get past it.
    limit = admitted_at_once(ctx)
    beams = len(prompts) * params.beam_width
    if limit is not None and beams > limit:
        raise bad_request(
            f"{len(prompts)} prompt(s) x beam width {params.beam_width} (n) = {beams} beams, "
            f"each scored as a request every step, but this server admits at most {limit} "
            "requests at once (--max-num-seqs + --max-waiting); ask for a smaller n or send "
            "fewer prompts per request", "n" if params.beam_width > limit else "prompt")
    log = request_log(request.scope)
    log.update(model=model_name, prompt_tokens=sum(len(p) for p in prompts),
               stream=bool(req.stream), beam_width=params.beam_width)
    response_id = new_id("chatcmpl" if chat else "cmpl")
    ctx.lifecycle.enter()
    try:
        outputs = await run_beam_search(request, ctx, f"{response_id}-{request_id_of(request.scope)}",
                                        prompts, params, model_name, req.priority)
    except ClientGone:
        log.update(finish_reason="client_disconnected")
        return Response(status_code=499)
    finally:
        ctx.lifecycle.exit()
    # A chat reply is split as a sampled one is (and as vLLM splits a beam's): with
    # --reasoning-parser the thinking goes to reasoning_content, not into content.
    reasoning_parser = ctx.config.reasoning_parser if chat else None
    reasoning_tokens: int | None = 0 if reasoning_parser else None
    choices = []
    for i, out in enumerate(outputs):
        for j, seq in enumerate(out.sequences):
            body: dict[str, Any] = {"text": (prefixes[i] if prefixes else "") + seq.text}
            if chat:
                message, thinking = _chat_message(ctx, prompts[i], seq, reasoning_parser)
                body = {"message": message}
                if reasoning_tokens is not None:
                    reasoning_tokens += thinking
            choices.append({"index": i * params.beam_width + j, **body, "logprobs": None,
                            "finish_reason": seq.finish_reason})
    completion_tokens = sum(len(seq.tokens) - len(prompt) for prompt, out in zip(prompts, outputs)
                            for seq in out.sequences)
    usage = usage_info(sum(len(p) for p in prompts), completion_tokens, 0, reasoning_tokens)
    log.update(completion_tokens=completion_tokens,
               finish_reason=",".join(sorted({c["finish_reason"] for c in choices})))
    created = now()
    kind = "chat.completion" if chat else "text_completion"
    if not req.stream:
        return JSONResponse({"id": response_id, "object": kind, "created": created,
                             "model": model_name, "choices": choices, "usage": usage})
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choice_list: list[dict[str, Any]], with_usage: bool = False) -> str:
        body = {"id": response_id, "object": kind + (".chunk" if chat else ""),
                "created": created, "model": model_name, "choices": choice_list}
        if include_usage:
            body["usage"] = usage if with_usage else None
        return sse(body)

    async def events() -> AsyncIterator[str]:
        for choice in choices:
            if chat:  # a chunk carries a delta, not a message
                choice = {("delta" if k == "message" else k): v for k, v in choice.items()}
            yield chunk([choice])
        if include_usage:
            yield chunk([], with_usage=True)
        yield SSE_DONE

    return GuardedStreamingResponse(events(), on_close=lambda: None)


def _chat_message(ctx: ServingContext, prompt: list[int], seq: BeamSearchSequence,
                  reasoning_parser: str | None) -> tuple[dict[str, Any], int]:
    """A hypothesis's chat message, and how many of its tokens are thinking (serving_chat's
    split and count)."""
    if not reasoning_parser:
        return {"role": "assistant", "content": seq.text}, 0
    reasoning, answer = split_reasoning(reasoning_parser, seq.text)
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    # seq.text is decoded without special tokens, as token_ends replays it
    ends = token_ends(ctx.tokenizer, prompt, seq.tokens[len(prompt):], True)
    return message, count_reasoning_tokens(reasoning_parser, seq.text, ends)
