"""POST /v1/chat/completions: the model's chat template, streaming or not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from argosy_runtime.outputs import CompletionOutput, RequestOutput
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.owners import owner_of
from argosy_runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    ContentPart,
    new_id,
    now,
)
from argosy_runtime.server.reasoning_parser import (
    ReasoningStream,
    count_reasoning_tokens,
    split_reasoning,
    token_ends,
)
from argosy_runtime.server.request_log import request_id_of, request_log
from argosy_runtime.server.serving_beam_search import beam_search_response
from argosy_runtime.server.serving_common import (
    SSE_DONE,
    ClientGone,
    ServingContext,
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
from argosy_runtime.server.tool_calls import (
    ToolCallStream,
    call_id_maker,
    calls_tools,
    may_call_tools,
    reply_message,
)
from argosy_runtime.server.tool_parsers import STREAMS, make_stream, parse_message
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

# Conversations this long or longer are rendered through the chat template on a worker thread.
RENDER_OFF_LOOP_MESSAGES = 1000
# Template variables a request sets through its own fields, never through chat_template_kwargs.
_TEMPLATE_VARIABLES_OF_THE_REQUEST = ("messages", "tools", "add_generation_prompt",
                                      "continue_final_message")
# Functions the server gives every template (transformers' globals): a value of that name
# would replace the function, and the template calling it would fail.
_TEMPLATE_FUNCTIONS = ("raise_exception", "strftime_now")


async def render_messages(ctx: ServingContext, chat_messages: list[ChatMessage],
                          tools: list[ChatTool] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          truncate: int | None = None, add_generation_prompt: bool = True,
                          continue_final_message: bool = False) -> list[int]:
    """The prompt token ids of a conversation, through the model's chat template (without
    `truncate`, a text too long for the model is a 400 before it is tokenized)."""
    def render() -> str:
        return render_chat_text(ctx, chat_messages, tools, add_generation_prompt,
                                template_kwargs, continue_final_message)

    # A template is Python (jinja) run per message: ~5 us each, so a 16 MiB body of tiny
    # messages held the event loop, and every stream on it, for 2.5 s. On a thread the loop
    # keeps its turns (the GIL switches between them); short chats stay inline.
    text = (await asyncio.to_thread(render) if len(chat_messages) >= RENDER_OFF_LOOP_MESSAGES
            else render())
    if not truncate:
        check_text_fits(ctx, text, "messages")
    # The template already holds any BOS it wants; adding special tokens would double it.
    [ids] = await encode_texts(ctx, [text], add_special_tokens=False)
    return ids


def render_chat_text(ctx: ServingContext, chat_messages: list[ChatMessage],
                     tools: list[ChatTool] | None, add_generation_prompt: bool,
                     template_kwargs: dict[str, Any] | None = None,
                     continue_final_message: bool = False) -> str:
    """The conversation through the model's chat template; `template_kwargs` (vLLM's
    chat_template_kwargs) are extra template variables, such as Qwen3's enable_thinking.
    `continue_final_message` (vLLM's, transformers'): the text ends with the final message's
    content, without what the template closes a turn with, for the model to continue it."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true: set add_generation_prompt to false to continue the final "
                          "message", "continue_final_message")
    for key in template_kwargs or ():
        if key in _TEMPLATE_VARIABLES_OF_THE_REQUEST:
            raise bad_request(f"chat_template_kwargs: {key!r} is set by the request itself "
                              f"(its messages, tools or add_generation_prompt)",
                              "chat_template_kwargs")
        if key in _TEMPLATE_FUNCTIONS:
            raise bad_request(f"chat_template_kwargs: {key!r} is a function the server gives "
                              "the chat template", "chat_template_kwargs")
    messages: list[dict[str, Any]] = []
    for m in chat_messages:
        content = m.content
        if isinstance(content, list):  # one text per part, joined as vLLM joins them
            content = "\n".join(part.text if isinstance(part, ContentPart) else part.refusal
                                for part in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": content or ""}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [template_tool_call(call) for call in m.tool_calls]
        if m.reasoning_content is not None:  # Qwen3's template shows it after the last user turn
            msg["reasoning_content"] = m.reasoning_content
        messages.append(msg)
    # Templates that know tools (Llama 3.1, Qwen2.5, ...) show them to the model.
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
    extra.update(template_kwargs or {})
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
    except ValueError as exc:
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc
    return _open_final_message(text, messages[-1]["content"]) if continue_final_message \
        else text


def _open_final_message(text: str, final: str) -> str:
    """`text` cut after the final message's content, as transformers' apply_chat_template
    cuts it for continue_final_message (its stripped content where a template strips it)."""
    for content in (final, final.strip()):
        if content and content in text:
            return text[: text.rindex(content) + len(content)]
    raise bad_request("continue_final_message: the final message's content is empty or not "
                      "in the rendered chat, so there is nothing to continue", "messages")


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends arguments as a JSON string; chat templates expect an object (as in
    transformers' tool-use convention)."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def chat_logprobs(ctx: ServingContext, seq: CompletionOutput, start: int, end: int,
                  k: int) -> dict[str, Any]:
    content = []
    positions = seq.logprobs or []
    for pos in range(start, min(end, len(positions), len(seq.token_ids))):
        token_id = seq.token_ids[pos]
        entry = positions[pos]
        lp = entry.get(token_id)
        text = token_text(ctx.tokenizer, token_id, lp)
        alts = []
        for t, alt in top_entries(entry, k):
            alt_text = token_text(ctx.tokenizer, t, alt)
            alts.append({"token": alt_text, "logprob": alt.logprob,
                         "bytes": token_bytes(ctx, t, alt_text)})
        content.append({"token": text, "logprob": -9999.0 if lp is None else lp.logprob,
                        "bytes": token_bytes(ctx, token_id, text), "top_logprobs": alts})
    return {"content": content}


def token_bytes(ctx: ServingContext, token_id: int, text: str) -> list[int]:
    """OpenAI's `bytes` of a token: its own bytes, so that the tokens of a character split
    across several (an emoji is 3 tokens of byte-level BPE, each decoded alone as U+FFFD)
    join back into it; the text's UTF-8 when it decodes whole (or is a special token)."""
    if "\ufffd" in text:
        raw = ctx.engine.engine.grammar_compiler.token_bytes(token_id)
        if raw is not None:
            return list(raw)
    return list(text.encode())


async def create_chat_completion(request: Request, req: ChatCompletionRequest,
                                 ctx: ServingContext) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    reject_unsupported(req, ctx.config.tool_call_parser)
    # tool_choice "auto" (or unset with tools): the parser reads the calls the model writes
    tool_parser = (ctx.config.tool_call_parser
                   if may_call_tools(req, ctx.config.tool_call_parser) else None)
    make_call_id = call_id_maker(ctx.config.tool_call_parser)  # forced/"required" calls' ids
    max_tokens = req.max_completion_tokens or req.max_tokens
    # a context-length error names the field the client set
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    prompt = await render_messages(ctx, req.messages, req.tools, req.chat_template_kwargs,
                                   req.truncate_prompt_tokens, req.add_generation_prompt,
                                   req.continue_final_message)
    [prompt] = truncate_prompts(ctx, [prompt], req.truncate_prompt_tokens, "messages",
                                max_tokens, max_tokens_param)
    if req.use_beam_search:  # up to the context's end unless max_tokens says otherwise
        return await beam_search_response(request, ctx, req, model_name, [prompt],
                                          max_tokens or ctx.max_model_len - len(prompt))
    k: int | None = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    params = make_sampling_params(req, max_tokens, k, ctx.tokenizer.vocab_size,
                                  owner_of(request))
    await compile_grammar(ctx, req, params)
    # A JSON reply (response_format) is the answer, not calls in the parser's format: no
    # parsing (a parser held it back to its end as a possible call: llama3_json's `{`,
    # pythonic's `[`). vLLM's `structured_outputs` may shape calls themselves (a regex of
    # the parser's format): parsed as usual.
    if req.response_format is not None and req.response_format.type != "text":
        tool_parser = None
    if tool_parser is not None and STREAMS[tool_parser].keep_special_tokens:
        # The format's marker may be a control token (Mistral's [TOOL_CALLS], Hermes 2 Pro's
        # <tool_call>): keep it in the text the parser reads, as vLLM's parsers do when the
        # request may call tools (without, `tool_parser` is None: no special tokens shown).
        params.skip_special_tokens = False
    # A constrained reply (forced tool calls, response_format) cannot think: nothing to split.
    reasoning_parser = (ctx.config.reasoning_parser
                        if params.structured_outputs is None else None)
    log = request_log(request.scope)
    log.update(model=model_name, prompt_tokens=len(prompt), stream=bool(req.stream))
    response_id = new_id("chatcmpl")
    created = now()
    ctx.lifecycle.enter()
    try:
        streams = await start_streams(ctx, f"{response_id}-{request_id_of(request.scope)}",
                                      [prompt], params, model_name, req.priority)
    except BaseException:
        ctx.lifecycle.exit()
        raise
    n = params.n

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk",
                                    "created": created, "model": model_name,
                                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        hold = stop_holdback(params)
        tool_stream = (ToolCallStream(req, n, make_call_id)
                       if calls_tools(req) else None)
        parsers = ([make_stream(tool_parser, req.parallel_tool_calls is not False)
                    for _ in range(n)] if tool_parser else None)
        thinking = ([ReasoningStream(reasoning_parser) for _ in range(n)]
                    if reasoning_parser else None)

        def delta_of(c: int, text: str, seq: CompletionOutput
                     ) -> tuple[dict[str, Any], str | None]:
            if tool_stream is not None:
                return tool_stream.delta(c, text, seq.finish_reason, seq.text)
            reasoning = ""
            if thinking is not None:  # the answer part goes on to the tool-call parser
                reasoning, text = thinking[c].feed(text, seq.finish_reason is not None)
            if parsers is not None:
                delta, finish = parsers[c].step(text, seq.finish_reason)
            else:
                delta, finish = ({"content": text} if text else {}), seq.finish_reason
            return ({"reasoning_content": reasoning, **delta} if reasoning else delta), finish

        async def events() -> AsyncIterator[str]:
            for c in range(n):  # the role first, as OpenAI does
                content = None if tool_stream is not None else ""
                yield chunk([{"index": c, "delta": {"role": "assistant", "content": content},
                              "logprobs": None, "finish_reason": None}],
                            usage_info(len(prompt), 0, 0) if continuous_usage else None)
            sent_chars = [0] * n
            sent_tokens = [0] * n
            done = [False] * n
            final: RequestOutput | None = None
            async for _, out in merge_streams(streams, constraint_source(req), log):
                final = out
                for seq in out.outputs:
                    c = seq.index
                    if done[c]:
                        continue
                    text, new_sent = visible_text(seq, sent_chars[c], hold)
                    start, end = sent_tokens[c], len(seq.token_ids)
                    delta, finish = delta_of(c, text, seq)
                    # The parsers keep what they hold back: this text is theirs either way.
                    sent_chars[c] = new_sent
                    if not delta and finish is None and (k is None or start == end):
                        continue
                    lp = chat_logprobs(ctx, seq, start, end, k) if k is not None else None
                    yield chunk([{"index": c, "delta": delta, "logprobs": lp,
                                  "finish_reason": finish}],
                                # this choice's count so far, as vLLM's
                                usage_info(len(prompt), end, out.num_cached_tokens)
                                if continuous_usage else None)
                    sent_tokens[c] = end
                    done[c] = seq.finish_reason is not None
            usage = _usage(ctx, prompt, final, params, reasoning_parser)
            log.update(completion_tokens=usage["completion_tokens"],
                       finish_reason=_reasons(final))
            if include_usage:
                yield chunk([], usage)
            yield SSE_DONE

        def on_timeout() -> str:
            log.update(finish_reason="timeout")
            return sse({"error": {"message": "request timed out", "type": "timeout_error",
                                  "param": None, "code": "request_timeout"}})

        def on_close() -> None:
            for s in streams:
                if not s.finished:
                    log.setdefault("finish_reason", "client_disconnected")
                s.close()
            ctx.lifecycle.exit()

        return GuardedStreamingResponse(with_deadline(ctx, events(), on_timeout), on_close)

    try:
        final = (await run_to_completion(request, ctx, streams, constraint_source(req)))[0]
    except ClientGone:
        log.update(finish_reason="client_disconnected")
        return Response(status_code=499)
    finally:
        ctx.lifecycle.exit()
    choices = []
    for seq in sorted(final.outputs, key=lambda s: s.index):
        reasoning, answer = (split_reasoning(reasoning_parser, seq.text) if reasoning_parser
                             else (None, seq.text))
        message, finish = {"role": "assistant", "content": answer}, seq.finish_reason
        if calls_tools(req):
            message, finish = reply_message(req, seq.text, seq.finish_reason, make_call_id)
        elif tool_parser:
            message, finish = parse_message(tool_parser, answer, seq.finish_reason,
                                            req.parallel_tool_calls is not False)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": seq.index, "message": message,
                        "logprobs": chat_logprobs(ctx, seq, 0, len(seq.token_ids), k)
                        if k is not None else None,
                        "finish_reason": finish})
    usage = _usage(ctx, prompt, final, params, reasoning_parser)
    log.update(completion_tokens=usage["completion_tokens"], finish_reason=_reasons(final))
    body = {"id": response_id, "object": "chat.completion", "created": created,
            "model": model_name, "choices": choices, "usage": usage}
    if req.prompt_logprobs is not None:  # vLLM's: once per reply, the prompt is shared
        body["prompt_logprobs"] = prompt_logprobs_json(ctx.tokenizer, final, req.prompt_logprobs)
    return JSONResponse(body)


def _usage(ctx: ServingContext, prompt: list[int], final: RequestOutput | None,
           params: SamplingParams, reasoning_parser: str | None) -> dict[str, Any]:
    """Chat's usage; with --reasoning-parser, how many completion tokens are thinking (0 for
    a constrained reply, which `reasoning_parser` None says: it could not think)."""
    reasoning: int | None = 0 if ctx.config.reasoning_parser else None
    if final is None:
        return usage_info(len(prompt), 0, 0, reasoning)
    if reasoning_parser is not None:
        prompt_ids = final.prompt_token_ids or prompt
        reasoning = sum(
            count_reasoning_tokens(reasoning_parser, seq.text, token_ends(
                ctx.tokenizer, prompt_ids, seq.token_ids, params.skip_special_tokens))
            for seq in final.outputs)
    return usage_info(len(prompt), sum(len(s.token_ids) for s in final.outputs),
                      final.num_cached_tokens, reasoning)


def _reasons(final: RequestOutput | None) -> str:
    return "" if final is None else ",".join(sorted({str(s.finish_reason)
                                                     for s in final.outputs}))
