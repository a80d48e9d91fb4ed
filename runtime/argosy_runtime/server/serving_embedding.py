"""POST /v1/embeddings: OpenAI's embeddings API over the engine's embedding requests.

Each input runs as its own engine request (PoolingParams: `--embedding-pooling`, L2-normalized)
beside whatever else is running, so embeddings join the continuous batch like prompts do.
`encoding_format: "base64"` (the official openai client's default) returns each vector as the
base64 of its little-endian float32 bytes, a quarter of the JSON text of the floats.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from dataclasses import replace

from argosy_runtime.outputs import RequestOutput
from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.server.errors import APIError, bad_request
from argosy_runtime.server.owners import cache_salt_of, owner_of
from argosy_runtime.server.protocol import EmbeddingRequest, new_id
from argosy_runtime.server.request_log import request_id_of, request_log
from argosy_runtime.server.serving_common import (
    ClientGone,
    ServingContext,
    admitted_at_once,
    run_to_completion,
    start_streams,
    truncate_prompts,
)
from argosy_runtime.server.serving_completion import normalize_prompts
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
# Inputs of one request admitted to the engine at a time: a long list (LangChain sends up to
# 1000) then waits its turn in slices instead of filling the waiting queue (`--max-waiting`)
# by itself and being refused.
INPUTS_IN_FLIGHT = 256


async def create_embedding(request: Request, req: EmbeddingRequest,
                           ctx: ServingContext) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    if ctx.class_labels:  # vLLM refuses too: a classifier's hidden state serves its head
        raise bad_request(f"model: {model_name} is a sequence-classification checkpoint: it "
                          "serves /v1/classify, /v1/score and /v1/rerank, not embeddings",
                          "model")
    # The full size is every model's; a shorter one only a Matryoshka-trained model's (the
    # engine checks, naming the sizes it accepts).
    dimensions = None if req.dimensions == ctx.embedding_size else req.dimensions
    _, prompts = await normalize_prompts(ctx, req.input, "input", MAX_EMBEDDING_INPUTS,
                                         req.truncate_prompt_tokens)
    prompts = truncate_prompts(ctx, prompts, req.truncate_prompt_tokens, "input")
    prompt_tokens = sum(len(p) for p in prompts)
    request_log(request.scope).update(model=model_name, prompt_tokens=prompt_tokens,
                                      inputs=len(prompts))
    vectors = await embed_prompts(request, ctx, prompts, model_name, req.priority, "embd",
                                  dimensions)
    if vectors is None:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model_name,
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


async def embed_prompts(request: Request, ctx: ServingContext, prompts: list[list[int]],
                        model_name: str, priority: int, kind: str,
                        dimensions: int | None = None) -> list[list[float]] | None:
    """The vectors of `prompts` (token ids already checked), in order, pooled as
    `--embedding-pooling` says (`pool_prompts`) and cut to `dimensions` (Matryoshka); None
    when the client went away. Every route that embeds (/v1/embeddings, /v1/score,
    /v1/rerank) runs through here, so they share pooling, admission, drain accounting and
    request ids (`kind` prefixes them)."""
    params = PoolingParams(pooling=ctx.config.embedding_pooling, dimensions=dimensions)
    finals = await pool_prompts(request, ctx, prompts, model_name, priority, kind, params)
    return None if finals is None else [out.embedding or [] for out in finals]


async def pool_prompts(request: Request, ctx: ServingContext, prompts: list[list[int]],
                       model_name: str, priority: int, kind: str,
                       params: PoolingParams | list[PoolingParams]
                       ) -> list[RequestOutput] | None:
    """The final outputs of `prompts` (token ids already checked) run as pooling requests
    (`params`: embeddings or classification; a list: one per prompt), in order: one engine
    request each, admitted `_inputs_in_flight` at a time at `priority`. None when the client
    went away (logged; the caller answers 499)."""
    log = request_log(request.scope)
    salt = cache_salt_of(owner_of(request), None)
    if salt is not None:  # each owner's prefix cache is its own (owners.py)
        params = ([replace(p, cache_salt=salt) for p in params] if isinstance(params, list)
                  else replace(params, cache_salt=salt))
    base_id = f"{new_id(kind)}-{request_id_of(request.scope)}"
    finals: list[RequestOutput] = []
    # --request-timeout bounds the whole request, not each slice (run_to_completion's own
    # timeout restarts with every slice).
    timeout = ctx.config.request_timeout
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    ctx.lifecycle.enter()
    try:
        step = _inputs_in_flight(ctx)
        for start in range(0, len(prompts), step):
            chunk = slice(start, start + step)
            streams = await start_streams(ctx, f"{base_id}-{start}", prompts[chunk],
                                          params[chunk] if isinstance(params, list) else params,
                                          model_name, priority)
            # Cancelled at the deadline, run_to_completion closes (aborts) the slice's streams.
            async with asyncio.timeout_at(deadline):
                finals.extend(await run_to_completion(request, ctx, streams))
    except TimeoutError as exc:
        raise APIError(408, f"request timed out after {timeout:g}s",
                       code="request_timeout") from exc
    except ClientGone:
        log.update(finish_reason="client_disconnected")
        return None
    finally:
        ctx.lifecycle.exit()
    _check_finite(ctx, finals)
    log.update(finish_reason="stop")
    return finals


def _check_finite(ctx: ServingContext, finals: list[RequestOutput]) -> None:
    """A 500 that says why when a vector or logit is NaN or infinite (activations that
    overflowed the model's dtype, float16 most often): JSON cannot carry such a value (the
    response would fail to render, an opaque 500), and base64 would hand the client NaNs as
    if they were a vector, or a score that sorts nowhere."""
    # The sum of finite float32 values is a finite float64, and NaN or inf makes it not.
    bad = sum(not math.isfinite(sum(out.classification.logits if out.classification is not None
                                    else out.embedding or []))
              for out in finals)
    if bad:
        raise APIError(500, f"the model's output for {bad} of the {len(finals)} texts of this "
                       "request is not finite (NaN or infinity): its activations overflowed "
                       f"in {ctx.engine.engine.dtype} (float16's range is the usual cause: "
                       "serve it in bfloat16 or float32)", code="non_finite_output")


def _inputs_in_flight(ctx: ServingContext) -> int:
    """How many inputs of one request to admit at a time: INPUTS_IN_FLIGHT, or fewer when
    even an idle server would refuse a slice that size (admitted_at_once)."""
    return min(INPUTS_IN_FLIGHT, admitted_at_once(ctx) or INPUTS_IN_FLIGHT)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
