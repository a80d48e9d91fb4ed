"""POST /v1/completions: text or token-id prompts (one or a batch), streaming or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from argosy_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from argosy_runtime.server.errors import APIError, bad_request
from argosy_runtime.server.owners import owner_of
from argosy_runtime.server.protocol import CompletionRequest, new_id, now
from argosy_runtime.server.request_log import request_id_of, request_log
from argosy_runtime.server.serving_beam_search import beam_search_response
from argosy_runtime.server.serving_common import (
    MAX_PROMPTS_PER_REQUEST,
    SSE_DONE,
    ClientGone,
    ServingContext,
    admitted_at_once,
    check_text_fits,
    compile_grammar,
    constraint_source,
    encode_texts,
    make_sampling_params,
    merge_streams,
    prompt_logprobs_json,
    reject_unsupported,
    run_to_completion,
    sse,
    start_streams,
    stop_holdback,
    token_text,
    top_entries,
    truncate_prompts,
    usage_info,
    visible_text,
    with_deadline,
)
from argosy_runtime.server.streaming import GuardedStreamingResponse
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response


async def normalize_prompts(ctx: ServingContext, prompt: Any, param: str = "prompt",
                            max_items: int = MAX_PROMPTS_PER_REQUEST,
                            truncate: int | None = None
                            ) -> tuple[list[str | None], list[list[int]]]:
    """str | list[str] | list[int] | list[list[int]] -> (texts, token id lists). Without
    `truncate` (the request's truncate_prompt_tokens) a text too long for the model whatever
    its tokenization is a 400 before it is tokenized; long texts are tokenized off the
    event loop (encode_texts)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    if len(items) > max_items:
        raise bad_request(f"{param}: at most {max_items} items per request", param)
    strings = [item for item in items if isinstance(item, str)]
    if not truncate:
        for i, item in enumerate(items):
            if isinstance(item, str):
                check_text_fits(ctx, item, param, index=i if len(items) > 1 else None)
    encoded = iter(await encode_texts(ctx, strings))
    texts: list[str | None] = []
    ids: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            ids.append(next(encoded))
        else:
            texts.append(None)
            ids.append(list(item))
    return texts, ids


def logprobs_block(ctx: ServingContext, seq: CompletionOutput, start: int, end: int,
                   k: int, offset: int) -> tuple[dict[str, Any], int]:
    """The OpenAI completions `logprobs` object for generated positions [start, end)."""
    block: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                             "text_offset": []}
    positions = seq.logprobs or []
    for pos in range(start, min(end, len(positions), len(seq.token_ids))):
        token_id = seq.token_ids[pos]
        entry = positions[pos]
        lp = entry.get(token_id)
        text = token_text(ctx.tokenizer, token_id, lp)
        block["tokens"].append(text)
        block["token_logprobs"].append(None if lp is None else lp.logprob)
        block["top_logprobs"].append(_top_logprobs(ctx, entry, token_id, lp, k))
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def prompt_logprobs_block(ctx: ServingContext, out: RequestOutput,
                          k: int) -> tuple[dict[str, Any], int]:
    """The `logprobs` object for an echoed prompt: each prompt token's log-probability given
    the tokens before it (none for the first) and the top k there, offsets from 0; and the
    offset where the generated tokens start."""
    block: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                             "text_offset": []}
    offset, scored = 0, out.prompt_logprobs or []
    for pos, token_id in enumerate(out.prompt_token_ids):
        entry = scored[pos] if pos < len(scored) else None
        lp = entry.get(token_id) if entry else None
        text = token_text(ctx.tokenizer, token_id, lp)
        block["tokens"].append(text)
        block["token_logprobs"].append(None if lp is None else lp.logprob)
        block["top_logprobs"].append(
            None if entry is None else _top_logprobs(ctx, entry, token_id, lp, k))
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def _top_logprobs(ctx: ServingContext, entry: dict[int, Logprob], token_id: int,
                  lp: Logprob | None, k: int) -> dict[str, float]:
    """One position's `top_logprobs`: the chosen token's, then the k most likely. OpenAI's
    legacy completions return "up to logprobs + 1 elements" (the chosen token always, so
    `logprobs: 0` is not an empty dict), as vLLM does; chat's `top_logprobs` is the top k
    only."""
    chosen = [] if lp is None else [(token_id, lp)]
    return {token_text(ctx.tokenizer, t, alt): alt.logprob
            for t, alt in chosen + [(t, a) for t, a in top_entries(entry, k) if t != token_id]}


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


async def create_completion(request: Request, req: CompletionRequest,
                            ctx: ServingContext) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    reject_unsupported(req)
    # OpenAI's legacy scoring idiom (lm-evaluation-harness): echo with max_tokens 0 returns the
    # prompt, and with logprobs each prompt token's log-probability, generating nothing (the
    # engine's prompt-only request, which needs no room past the prompt: it may fill the
    # whole context).
    if req.max_tokens == 0 and (not req.echo or req.use_beam_search):
        raise bad_request("max_tokens 0 returns the prompt alone: it needs echo, without "
                          "use_beam_search", "max_tokens")
    max_tokens = req.max_tokens
    texts, prompts = await normalize_prompts(ctx, req.prompt, truncate=req.truncate_prompt_tokens)
    cut = truncate_prompts(ctx, prompts, req.truncate_prompt_tokens, "prompt", max_tokens)
    # echo returns the prompt the model saw: a truncated one is decoded, not the text sent.
    # Decoded with its special tokens, as vLLM echoes token ids: dropping them made the echo
    # shorter than its logprobs `tokens`, whose text_offsets then overlapped the generated ones.
    texts = [t if len(c) == len(p) else None for t, c, p in zip(texts, cut, prompts)]
    prompts = cut
    prefixes = [(t or ctx.tokenizer.decode(ids, skip_special_tokens=False)) if req.echo else ""
                for t, ids in zip(texts, prompts, strict=True)]
    if req.use_beam_search:  # null max_tokens: up to the context's end, as for sampling
        max_tokens = max_tokens or ctx.max_model_len - max(len(p) for p in prompts)
        return await beam_search_response(request, ctx, req, model_name, prompts,
                                          max_tokens, prefixes)
    params = make_sampling_params(req, max_tokens, req.logprobs, ctx.tokenizer.vocab_size,
                                  owner_of(request))
    if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
        params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    await compile_grammar(ctx, req, params)
    log = request_log(request.scope)
    log.update(model=model_name, prompt_tokens=sum(len(p) for p in prompts),
               stream=bool(req.stream))
    limit = admitted_at_once(ctx)
    if limit is not None and len(prompts) > limit:  # they are admitted together
        raise bad_request(f"prompt: {len(prompts)} prompts, but this server admits at most "
                          f"{limit} requests at once (--max-num-seqs + --max-waiting); send "
                          "fewer per request", "prompt")
    response_id = new_id("cmpl")
    created = now()
    ctx.lifecycle.enter()
    try:
        streams = await start_streams(ctx, f"{response_id}-{request_id_of(request.scope)}",
                                      prompts, params, model_name, req.priority)
    except BaseException:
        ctx.lifecycle.exit()
        raise
    n = params.n
    k = req.logprobs

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  with_usage: bool = False) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "text_completion",
                                    "created": created, "model": model_name,
                                    "choices": choices}
            if include_usage or with_usage:
                body["usage"] = usage
            return sse(body)

        hold = stop_holdback(params)

        async def events() -> AsyncIterator[str]:
            sent_chars: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            offsets: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            async for i, out in merge_streams(streams, constraint_source(req), log):
                finals[i] = out
                for seq in out.outputs:
                    c = i * n + seq.index
                    if c in sent_chars and sent_chars[c] < 0:
                        continue  # already finished
                    first = c not in sent_chars
                    delta, new_sent = visible_text(seq, sent_chars.get(c, 0), hold)
                    start = sent_tokens.get(c, 0)
                    end = len(seq.token_ids)
                    if not delta and seq.finish_reason is None and (k is None or start == end):
                        continue
                    lp = prompt_lp = None
                    if k is not None:
                        if first and req.echo:  # the generated offsets follow the prompt's
                            prompt_lp, offsets[c] = prompt_logprobs_block(ctx, out, k)
                        lp, offsets[c] = logprobs_block(ctx, seq, start, end, k,
                                                         offsets.get(c, 0))
                        if prompt_lp is not None:
                            lp = joined(prompt_lp, lp)
                    text = (prefixes[i] if first else "") + delta
                    yield chunk([{"index": c, "text": text, "logprobs": lp,
                                  "finish_reason": seq.finish_reason}],
                                # this choice's counts so far, as vLLM's
                                usage_info(len(prompts[i]), end, out.num_cached_tokens)
                                if continuous_usage else None)
                    sent_chars[c] = new_sent if seq.finish_reason is None else -1
                    sent_tokens[c] = end
            usage = _usage(prompts, finals)
            log.update(completion_tokens=usage["completion_tokens"],
                       finish_reason=_reasons(finals))
            if include_usage:
                yield chunk([], usage)
            yield SSE_DONE

        def on_timeout() -> str:
            log.update(finish_reason="timeout")
            return sse({"error": {"message": "request timed out", "type": "timeout_error",
                                  "param": None, "code": "request_timeout"}})

        return GuardedStreamingResponse(with_deadline(ctx, events(), on_timeout),
                                        on_close=lambda: _close(ctx, streams, log))

    try:
        finals_list = await run_to_completion(request, ctx, streams, constraint_source(req))
    except ClientGone:
        log.update(finish_reason="client_disconnected")
        return Response(status_code=499)
    finally:
        ctx.lifecycle.exit()
    finals = dict(enumerate(finals_list))
    choices = []
    for i, out in finals.items():
        for seq in out.outputs:
            lp = None
            if k is not None:
                end = len(seq.token_ids)
                prompt_lp, offset = (prompt_logprobs_block(ctx, out, k) if req.echo
                                     else (None, 0))  # the generated offsets follow the prompt's
                lp = logprobs_block(ctx, seq, 0, end, k, offset)[0]
                if prompt_lp is not None:
                    lp = joined(prompt_lp, lp)
            choice = {"index": i * n + seq.index,
                      "text": prefixes[i] + seq.text, "logprobs": lp,
                      "finish_reason": seq.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(ctx.tokenizer, out,
                                                                 req.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    usage = _usage(prompts, finals)
    log.update(completion_tokens=usage["completion_tokens"], finish_reason=_reasons(finals))
    return JSONResponse({"id": response_id, "object": "text_completion", "created": created,
                         "model": model_name, "choices": choices, "usage": usage})


def _usage(prompts: list[list[int]], finals: dict[int, RequestOutput]) -> dict[str, Any]:
    generated = sum(len(s.token_ids) for out in finals.values() for s in out.outputs)
    return usage_info(sum(len(p) for p in prompts), generated,
                      sum(out.num_cached_tokens for out in finals.values()))


def _reasons(finals: dict[int, RequestOutput]) -> str:
    return ",".join(sorted({str(s.finish_reason) for o in finals.values() for s in o.outputs}))


def _close(ctx: ServingContext, streams: list, log: dict[str, Any]) -> None:
    """Runs when the streaming response ends for any reason (done, disconnect, error)."""
    for s in streams:
        if not s.finished:
            log.setdefault("finish_reason", "client_disconnected")
        s.close()
    ctx.lifecycle.exit()


__all__ = ["create_completion", "APIError"]
