"""What completions and chat share: request -> SamplingParams, admission, running requests
under a deadline with disconnect detection, and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from argosy_runtime.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from argosy_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.server.config import ServerConfig
from argosy_runtime.server.errors import APIError, bad_request, param_from_value_error
from argosy_runtime.server.lifecycle import Lifecycle
from argosy_runtime.server.metrics import ServerMetrics
from argosy_runtime.server.owners import cache_salt_of
from argosy_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from argosy_runtime.server.request_log import request_log
from argosy_runtime.server.tool_calls import calls_tools, check_tool_choice, tool_call_constraint
from argosy_runtime.structured_output import StructuredOutputsParams
from starlette.requests import Request

logger = logging.getLogger(__name__)

MAX_PROMPTS_PER_REQUEST = 64


@dataclass
class ServingContext:
    """Everything a handler needs; one per app."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    config: ServerConfig
    lifecycle: Lifecycle
    metrics: ServerMetrics
    # The LoRA adapters served now, beside the base model (they can change while serving).
    adapter_names: Callable[[], tuple[str, ...]] = tuple
    embedding_size: int = 0  # the length of /v1/embeddings' vectors (the hidden size)
    # A sequence-classification checkpoint's labels (config id2label), in class order;
    # empty for every other model. /v1/classify needs them; one label makes /v1/score and
    # /v1/rerank cross-encoder scores.
    class_labels: tuple[str, ...] = ()
    # How a cross-encoder without a score template joins a pair (ModelSpec.use_sep_token):
    # the tokenizer's pair template, or text_1 + text_2 (an LLM reranker).
    use_sep_token: bool = True
    # An encoder-only model (BERT, XLM-RoBERTa): truncation keeps its first token ([CLS]) and
    # cuts from the right, as transformers' tokenizer(..., truncation=True) does.
    encoder: bool = False
    # The tokens that end generation (LLMEngine.end_token_ids): where a beam search's
    # hypotheses end.
    end_token_ids: frozenset[int] = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self.adapter_names()

    def check_model(self, model: str | None) -> str:
        """The served name a request asks for (the base model when it names none)."""
        if model is None or model == self.model_name or model in self.lora_names:
            return model or self.model_name
        served = ", ".join(repr(m) for m in (self.model_name, *self.lora_names))
        raise APIError(404, f"model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def lora_name(self, model_name: str) -> str | None:
        """The LoRA adapter behind a served name (None: the base model)."""
        return model_name if model_name != self.model_name else None

    def check_accepting(self) -> None:
        if self.lifecycle.draining:
            self.metrics.reject("draining")
            raise APIError(503, "server is draining (shutting down); retry on another replica",
                           code="server_draining", headers={"Retry-After": "1"})
        if not self.engine.is_alive:
            raise APIError(503, "engine is not running", code="engine_unavailable")


def reject_unsupported(req: CompletionRequest | ChatCompletionRequest,
                       tool_call_parser: str | None = None) -> None:
    """OpenAI fields we parse but cannot honour: a clear 400 rather than a silent ignore."""
    if req.stream_options is not None and not req.stream:  # OpenAI's and vLLM's rule too
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream (vLLM's rule): they "
                          "come with the whole reply", "prompt_logprobs")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of different from n is not supported", "best_of")
    else:
        check_tool_choice(req, tool_call_parser)


def make_sampling_params(req: CompletionRequest | ChatCompletionRequest,
                         max_tokens: int | None, logprobs: int | None,
                         vocab_size: int | None = None,
                         owner: str | None = None) -> SamplingParams:
    """The request's SamplingParams; `vocab_size` (the tokenizer's): stop_token_ids outside
    it are a 400, as such prompt ids are (they could never be sampled). `owner`: the tenant
    the request names (owners.py), whose prefix cache is its own."""
    if vocab_size is not None:
        check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    try:
        return SamplingParams(
            n=req.n if req.n is not None else 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            logit_bias=logit_bias_of(req),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            structured_outputs=structured_outputs_of(req),
            cache_salt=cache_salt_of(owner, req.cache_salt),
        )
    except ValueError as exc:
        raise bad_request(str(exc), param_from_value_error(str(exc))) from exc


def logit_bias_of(req: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        # Plain ASCII digits only: int() would also take " 5", "1_0" (10) and "٣" (3).
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}",
                              "logit_bias")
        bias[int(key)] = value
    return bias


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # bounded: int() refuses 4300+ digits


def constraint_source(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field that constrains the output, if any: one at most."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        # would be ignored, leaving the output unconstrained by the schema the client sent
        raise bad_request(f"response_format.json_schema: only allowed with type 'json_schema', "
                          f"not {fmt.type!r}", "response_format")
    sources = []  # the 400 names the last one: an extra or tools added to a plain request
    if req.response_format is not None and req.response_format.type != "text":
        sources.append("response_format")
    if req.structured_outputs is not None:
        sources.append("structured_outputs")
    if isinstance(req, ChatCompletionRequest) and calls_tools(req):
        sources.append("tool_choice")
    if len(sources) > 1:
        raise bad_request(f"{' and '.join(sources)} cannot be used together", sources[-1])
    return sources[0] if sources else None


def structured_outputs_of(req: CompletionRequest | ChatCompletionRequest
                          ) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs`, OpenAI's `response_format`, or the tool-call format."""
    source = constraint_source(req)
    try:
        if source == "structured_outputs":
            so = req.structured_outputs
            if so.structural_tag is not None:
                raise ValueError("structured_outputs.structural_tag is not supported; use "
                                 "tools with tool_choice, or a grammar")
            return StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                whitespace_pattern=so.whitespace_pattern,
                disable_additional_properties=so.disable_additional_properties)
        if source == "response_format":
            fmt = req.response_format
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None:
                raise ValueError("json_schema is required when type is 'json_schema'")
            return StructuredOutputsParams(json=fmt.json_schema.schema_ or {})  # none: any JSON
        if source == "tool_choice":
            return tool_call_constraint(req)
    except ValueError as exc:
        raise constraint_error(source, exc) from exc
    return None


def constraint_error(source: str, exc: ValueError) -> APIError:
    """A 400 for a spec that cannot compile, worded in the fields the client wrote."""
    message = str(exc)
    if source == "structured_outputs":
        return bad_request(message, param_from_value_error(message))
    message = message.removeprefix("structured_outputs: ")
    if source == "response_format":
        message = message.replace("structured_outputs.json", "json_schema.schema")
        return bad_request(f"response_format: {message}", "response_format")
    message = message.replace("structured_outputs.json", "parameters")
    return bad_request(f"tools: {message}", "tools")


async def compile_grammar(ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest,
                          params: SamplingParams) -> None:
    """Compile a request's grammar in a worker thread before admitting it: a bad spec is a 400
    naming its field, and a slow one never stalls the engine thread (it finds it cached)."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(ctx.engine.engine.grammar_compiler.check,
                                params.structured_outputs)
    except ValueError as exc:
        raise constraint_error(constraint_source(req), exc) from exc


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming `param` for an id outside [0, vocab_size)."""
    for t in token_ids:
        if isinstance(t, bool) or not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab_size})",
                              param)


def check_prompt(ctx: ServingContext, token_ids: list[int], max_tokens: int | None,
                 param: str = "prompt", max_tokens_param: str = "max_tokens",
                 index: int | None = None) -> None:
    """Reject prompts the engine cannot run with a 400 before they reach it. The length is
    checked first: it is cheap, and a long list of ids need not be walked to be refused. The
    error names the field to change: `max_tokens_param` (chat's max_completion_tokens) when
    the prompt would fit alone, else `param`; and, for one prompt of several, its `index`."""
    if not token_ids:
        raise bad_request(f"{param} must not be empty", param)
    need = len(token_ids) + (1 if max_tokens is None else max_tokens)
    if need > ctx.max_model_len:
        what = f" + {max_tokens_param} {max_tokens}" if max_tokens else ""
        blame = max_tokens_param if max_tokens and len(token_ids) < ctx.max_model_len else param
        raise bad_request(
            f"this model's maximum context length is {ctx.max_model_len} tokens; "
            f"{_the_prompt(param, index)} has {len(token_ids)} tokens{what}", blame,
            code="context_length_exceeded")
    check_token_ids(token_ids, ctx.tokenizer.vocab_size, param)


def _the_prompt(param: str, index: int | None) -> str:
    """How an error names the prompt: which one of a batch (among a thousand inputs, "the
    prompt" left the client to find it)."""
    return "the prompt" if index is None else f"{param}[{index}]"


# Texts this long (~10 ms of tokenizer time) or longer are tokenized in a worker thread: the
# tokenizer releases the GIL (`Tokenizer.encode`), so the event loop keeps serving the other
# requests meanwhile (a 10 MB prompt used to freeze every stream for ~25 s). Shorter ones run
# inline: cheaper than a thread hop, and never queued behind a big one in the thread pool.
TOKENIZE_OFF_LOOP_CHARS = 50_000
T = TypeVar("T")


async def run_tokenizer(num_chars: int, tokenize: Callable[[], T]) -> T:
    """`tokenize()`, off the event loop when it reads `num_chars` >= TOKENIZE_OFF_LOOP_CHARS."""
    if num_chars < TOKENIZE_OFF_LOOP_CHARS:
        return tokenize()
    return await asyncio.to_thread(tokenize)


async def encode_texts(ctx: ServingContext, texts: list[str],
                       add_special_tokens: bool = True) -> list[list[int]]:
    """Each text's token ids (see run_tokenizer)."""
    return await run_tokenizer(sum(len(t) for t in texts), lambda: [
        ctx.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts])


def check_text_fits(ctx: ServingContext, text: str, param: str,
                    index: int | None = None) -> None:
    """400 for a text too long for the model's context whatever its tokenization (more
    characters than max_model_len tokens of the tokenizer's longest can cover), before
    spending tokenizer time on it. Callers skip it when the request truncates the prompt.
    `index`: which of several prompts it is."""
    bound = getattr(ctx.tokenizer, "character_bound", None)
    limit = ctx.max_model_len * bound.per_token if bound is not None else None
    # counting skips the characters the tokenizer drops: only worth it past the plain length
    if limit is not None and len(text) > limit and (counted := bound.counted(text)) > limit:
        raise bad_request(
            f"this model's maximum context length is {ctx.max_model_len} tokens; "
            f"{_the_prompt(param, index)} has {counted} characters, more than {ctx.max_model_len} tokens can hold (at "
            f"most {bound.per_token} characters each)", param, code="context_length_exceeded")


def check_truncate_prompt_tokens(ctx: ServingContext, truncate: int | None) -> None:
    """400 for a `truncate_prompt_tokens` longer than the model's context."""
    if truncate is not None and truncate > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({truncate}) is larger than this model's "
                          f"maximum context length {ctx.max_model_len}",
                          "truncate_prompt_tokens")


def truncate_prompts(ctx: ServingContext, prompts: list[list[int]], truncate: int | None,
                     param: str, max_tokens: int | None = 0,
                     max_tokens_param: str = "max_tokens") -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens`, on every route that takes it: keep each prompt's last
    k tokens (an encoder's: its first k - 1 and its last, the [CLS] ... [SEP] that
    transformers' right truncation keeps; 0 or None: all of it); -1 keeps as many as fit
    beside the output, `max_tokens`
    (0 for pooling routes: the model's length; None, generation up to the model's length: one
    token held back, as vLLM does). Then each prompt is checked (`check_prompt`), so a k that
    leaves no room for max_tokens is still a 400. An encoder's k of 1 or 2 is a 400: see
    below."""
    check_truncate_prompt_tokens(ctx, truncate)
    if ctx.encoder and truncate in (1, 2):
        # transformers' cut (vLLM's) keeps [CLS] and [SEP]: k = 2 leaves none of the text,
        # so every text is the same prompt (two long texts score exactly 1.0), and k = 1
        # cannot hold them (transformers then leaves the text whole). Neither is a cut.
        raise bad_request(
            f"truncate_prompt_tokens ({truncate}) must be at least 3 on this encoder model: "
            "the cut keeps its [CLS] and [SEP] tokens and at least one token of the text",
            "truncate_prompt_tokens")
    keep = truncate
    if truncate == -1:
        keep = max(1, ctx.max_model_len - (1 if max_tokens is None else max_tokens))
    out = []
    for i, ids in enumerate(prompts):
        if keep and len(ids) > keep:
            ids = ids[: keep - 1] + ids[-1:] if ctx.encoder else ids[-keep:]
        check_prompt(ctx, ids, max_tokens, param=param, max_tokens_param=max_tokens_param,
                     index=i if len(prompts) > 1 else None)
        out.append(ids)
    return out


def admitted_at_once(ctx: ServingContext) -> int | None:
    """How many requests an idle server admits at once (`--max-num-seqs` into the batch,
    `--max-waiting` beside it), None when the waiting queue is unbounded. More prompts than
    this in one request, admitted together, would get a 429 that no retry can get past."""
    engine = ctx.engine
    if not engine.max_waiting:  # 0: unbounded
        return None
    return engine.max_waiting + (engine.max_num_seqs or 0)


async def start_streams(ctx: ServingContext, base_id: str, prompts: list[list[int]],
                        params: Any, model_name: str,
                        priority: int = 0) -> list[RequestStream]:
    """Admit every prompt of a request (all or none), in the same engine step, at
    `priority` (lower runs earlier). `params`: SamplingParams or PoolingParams for all of
    them, or a list with one per prompt (a cross-encoder pair's token types)."""
    ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    lora_name = ctx.lora_name(model_name)
    # gather posts every add before awaiting any, so the prompts join the batch together
    adds = [asyncio.ensure_future(ctx.engine.add(rid, p, ps, priority=priority,
                                                 lora_name=lora_name))
            for rid, p, ps in zip(ids, prompts, each, strict=True)]
    try:
        results = await asyncio.gather(*adds, return_exceptions=True)
    except asyncio.CancelledError:
        # Cancelled while admitting (a cancelled batch's request, a beam search's deadline):
        # an add cut short aborts its own request, but those already admitted have no
        # reader, and ran on to their last token (their streams kept for good).
        for add in adds:  # all done by now: gather waits for its children's cancellation
            if add.done() and not add.cancelled() and add.exception() is None:
                add.result().close()
        raise
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return streams
    for s in streams:
        s.close()
    exc = errors[0]
    if isinstance(exc, QueueFullError):
        ctx.metrics.reject("queue_full")
        raise APIError(429, f"server is at capacity ({exc}); retry later",
                       code="queue_full",
                       headers={"Retry-After": str(ctx.config.retry_after_s)}) from exc
    if isinstance(exc, ValueError):
        if lora_name is not None and lora_name not in ctx.lora_names:
            # Its adapter was unloaded after check_model (while it waited for a slot, or
            # before the engine thread took it): the 404 of any unknown model, not a 400.
            ctx.check_model(model_name)
        raise bad_request(str(exc), param_from_value_error(str(exc))) from exc
    if isinstance(exc, EngineDeadError):
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    raise exc


async def merge_streams(streams: list[RequestStream], constraint: str | None = None,
                        log: dict[str, Any] | None = None
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from several requests as they progress. A sequence that
    failed mid-generation (finish_reason "error") fails them all with its APIError
    (`failed_sequence_error`), after its output is yielded once more with that sequence
    still running: the text it generated up to the failure (possibly merged into the same
    output as the failure, when the reader lags) reaches the client before the error. The
    request `log` (request_log) then records finish_reason "error". Leaving closes the
    streams, which aborts the rest."""
    async with contextlib.aclosing(_interleave(streams)) as outputs:
        async for i, out in outputs:
            error = failed_sequence_error(out, constraint)
            if error is not None:
                yield i, before_failure(out)
                _log_failure(log)
                raise error
            yield i, out


async def _interleave(streams: list[RequestStream]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) in the order the outputs arrive; closing it closes the streams."""
    if len(streams) == 1:  # no pump task to hop through
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    # Bounded: a pump waits for the reader, and its stream meanwhile keeps only its newest
    # output (each is cumulative). Unbounded, a client that read slowly had every step's
    # whole output so far queued for it: memory as the square of the output's length.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(
        maxsize=len(streams))

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def run_to_completion(request: Request, ctx: ServingContext,
                            streams: list[RequestStream], constraint: str | None = None
                            ) -> list[RequestOutput]:
    """Non-streaming: wait for every request's final output, aborting if the client leaves
    or the deadline passes. `constraint`: the request field its grammar came from
    (`constraint_source`), named by the 400 when that grammar fails mid-generation."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def collect() -> None:
        async for i, out in merge_streams(streams, constraint, request_log(request.scope)):
            finals[i] = out

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    collector = asyncio.create_task(collect())
    watcher = asyncio.create_task(wait_disconnect())
    try:
        timeout = ctx.config.request_timeout or None
        done, _ = await asyncio.wait({collector, watcher}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if collector in done:
            collector.result()  # re-raise an engine failure
            return [f for f in finals if f is not None]
        if watcher in done:
            raise ClientGone()
        raise APIError(408, f"request timed out after {ctx.config.request_timeout:g}s",
                       code="request_timeout")
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    finally:
        for t in (collector, watcher):
            t.cancel()
        for t in (collector, watcher):
            with contextlib.suppress(BaseException):
                await t
        for s in streams:
            s.close()


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def failed_sequence_error(out: RequestOutput, constraint: str | None) -> APIError | None:
    """The APIError of a sequence that failed mid-generation (finish_reason "error"), if
    any: its grammar hit one of llguidance's limits after `compile_grammar` passed it. A 400
    in the terms of the field the client wrote (`constraint`), never a "stop" whose output
    does not match."""
    for seq in out.outputs:
        if seq.finish_reason == "error":
            message = seq.error or "generation failed"
            if message.startswith("structured_outputs"):
                return constraint_error(constraint or "structured_outputs", ValueError(message))
            return APIError(500, message, code="generation_failed")
    return None


def before_failure(out: RequestOutput) -> RequestOutput:
    """`out` with its failed sequences shown still running (no finish_reason, no error): what
    a stream sends before the error event, so their text so far is not lost."""
    return replace(out, finished=False, outputs=[
        replace(seq, finish_reason=None, error=None) if seq.finish_reason == "error" else seq
        for seq in out.outputs])


def _log_failure(log: dict[str, Any] | None) -> None:
    if log is not None:
        log["finish_reason"] = "error"


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's `usage`; `cached_tokens`: prompt tokens served from the prefix cache;
    `reasoning_tokens` (those of completion_tokens that are thinking) only where a reasoning
    parser can tell, as vLLM: elsewhere `completion_tokens_details` is left out."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def with_deadline(ctx: ServingContext, gen: AsyncIterator[str],
                        on_timeout: Callable[[], str]) -> AsyncIterator[str]:
    """Stream `gen`, ending with an error event if the request runs past its deadline or
    the engine ends it (a failed step, an abort on shutdown, a grammar that failed
    mid-generation): the response is already under way, so the client learns why from the
    stream rather than from a cut connection."""
    timeout = ctx.config.request_timeout or None
    deadline = None if timeout is None else time.monotonic() + timeout
    it = gen.__aiter__()
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                chunk = await asyncio.wait_for(_anext(it), timeout=left)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield on_timeout()
                yield SSE_DONE
                return
            except EngineDeadError as exc:
                yield sse({"error": {"message": str(exc), "type": "server_error",
                                     "param": None, "code": "engine_unavailable"}})
                yield SSE_DONE
                return
            except APIError as exc:  # a sequence failed mid-generation (merge_streams)
                yield sse(exc.body())
                yield SSE_DONE
                return
            except Exception:  # a bug making the stream's events (a parser's, say)
                # The status line went out: without an event the client saw the connection
                # cut, with no word of why and no [DONE]. The traceback is for the log.
                logger.exception("a stream failed mid-answer")
                yield sse({"error": {"message": "internal server error while streaming the "
                                                "answer (the server's log has the traceback)",
                                     "type": "server_error", "param": None,
                                     "code": "internal_error"}})
                yield SSE_DONE
                return
            yield chunk
    finally:
        await it.aclose()  # type: ignore[attr-defined]


def _anext(it: AsyncIterator[str]) -> Awaitable[str]:
    return it.__anext__()


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def prompt_logprobs_json(tokenizer: Any, out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` reply field: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} for the token itself and the top k there."""
    entries: list[dict | None] = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        entries.append(None if entry is None else {
            t: {"logprob": lp.logprob, "rank": lp.rank,
                "decoded_token": token_text(tokenizer, t, lp)}
            for t, lp in entry.items() if t == token_id or lp.rank <= k})
    return entries


def top_entries(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives at one position, most likely first."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
    return [(t, lp) for t, lp in ranked if lp.rank <= k][:k]


def visible_text(seq: CompletionOutput, sent: int, hold: int) -> tuple[str, int]:
    """The text to stream now and the new sent length.

    While a sequence runs, the last `hold` characters (longest stop string - 1) stay back:
    the engine trims a stop string that spans several tokens from its text, and characters
    already streamed cannot be taken back.
    """
    limit = len(seq.text) if seq.finish_reason is not None else len(seq.text) - hold
    if limit <= sent:
        return "", sent
    return seq.text[sent:limit], limit


def stop_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop or []), default=1) - 1
