"""POST /v1/score and POST /v1/rerank: vLLM's scoring APIs for embedding (bi-encoder) models.

A pair's score is the cosine similarity of the two texts' pooled embeddings, what vLLM
answers for an embedding model: each text runs as one embedding request (`embed_prompts`,
the same pooling, admission and priority as /v1/embeddings), and each distinct text runs once
however many pairs it is in (a rerank query meets every document, but is embedded once).
Like /v1/embeddings, any model serves these: a generative model has hidden states too.

`/v1/score` pairs `text_1` with `text_2`: 1-to-1, 1-to-N (one `text_1` against every
`text_2`) or N-to-N (equal lengths, pair by pair). `/v1/rerank` (also `/rerank`, and Cohere's
`/v2/rerank`) is Jina's and Cohere's schema as vLLM serves it: `query` against `documents`,
sorted by relevance, the first `top_n`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import new_id
from argosy_runtime.server.request_log import request_log
from argosy_runtime.server.serving_common import ServingContext, check_prompt
from argosy_runtime.server.serving_completion import normalize_prompts
from argosy_runtime.server.serving_embedding import MAX_EMBEDDING_INPUTS, embed_prompts
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response

_FORBID = ConfigDict(extra="forbid")  # an unknown field is a 400, as on every route
_PRIORITY = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)
# vLLM's truncate_prompt_tokens: keep the last k tokens of each text; -1: the model's length.
_TRUNCATE = Field(default=None, ge=-1)


class ScoreRequest(BaseModel):
    """POST /v1/score (vLLM's, text inputs)."""

    model_config = _FORBID
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: StrictInt | None = _TRUNCATE
    priority: StrictInt = _PRIORITY


class RerankRequest(BaseModel):
    """POST /v1/rerank (Jina's and Cohere's, as vLLM serves it). `top_n` 0 or absent: every
    document (vLLM's default is 0); `return_documents` as Jina and Cohere."""

    model_config = _FORBID
    model: str | None = None
    query: str
    documents: list[str]
    top_n: StrictInt | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: StrictInt | None = _TRUNCATE
    priority: StrictInt = _PRIORITY


async def create_score(request: Request, req: ScoreRequest, ctx: ServingContext) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    firsts = _tokenize(ctx, req.text_1, "text_1", req.truncate_prompt_tokens)
    seconds = _tokenize(ctx, req.text_2, "text_2", req.truncate_prompt_tokens)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)  # 1-to-N (and 1-to-1)
    elif len(firsts) != len(seconds):
        raise bad_request(
            f"text_2 has {len(seconds)} texts and text_1 has {len(firsts)}: send one text_1 "
            "(scored against every text_2) or as many as text_2 (scored pair by pair)",
            "text_2")
    scored = await _cosine_scores(request, ctx, model_name, req.priority, "score",
                                  list(zip(firsts, seconds, strict=True)))
    if scored is None:
        return Response(status_code=499)
    scores, prompt_tokens = scored
    return JSONResponse({
        "id": new_id("score"), "object": "list", "created": int(time.time()),
        "model": model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0},
    })


async def create_rerank(request: Request, req: RerankRequest, ctx: ServingContext) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    [query] = _tokenize(ctx, req.query, "query", req.truncate_prompt_tokens)
    documents = _tokenize(ctx, req.documents, "documents", req.truncate_prompt_tokens)
    scored = await _cosine_scores(request, ctx, model_name, req.priority, "rerank",
                                  [(query, d) for d in documents])
    if scored is None:
        return Response(status_code=499)
    scores, prompt_tokens = scored
    # Most relevant first; equal scores keep the documents' order (sorted is stable).
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    results = []
    for i in ranked:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    # prompt_tokens beside Jina's total_tokens: the gateway charges tenants prompt tokens.
    return JSONResponse({"id": new_id("rerank"), "model": model_name,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "total_tokens": prompt_tokens},
                         "results": results})


def _tokenize(ctx: ServingContext, texts: str | list[str], param: str,
              truncate: int | None) -> list[tuple[int, ...]]:
    """Each text's token ids (tuples: they key the de-duplication), truncated on the left
    as vLLM's `truncate_prompt_tokens` does, then checked like an embeddings input."""
    if truncate is not None and truncate > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({truncate}) is larger than this model's "
                          f"maximum context length {ctx.max_model_len}",
                          "truncate_prompt_tokens")
    keep = ctx.max_model_len if truncate == -1 else truncate
    _, prompts = normalize_prompts(ctx, texts, param, MAX_EMBEDDING_INPUTS)
    out = []
    for ids in prompts:
        if keep:  # 0 keeps all: vLLM's Field(ge=-1) lets it through, and nothing is cut
            ids = ids[-keep:]
        check_prompt(ctx, ids, 0, param=param)
        out.append(tuple(ids))
    return out


async def _cosine_scores(request: Request, ctx: ServingContext, model_name: str,
                         priority: int, kind: str,
                         pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]
                         ) -> tuple[list[float], int] | None:
    """The cosine similarity of each pair's embeddings and the prompt tokens embedded (each
    distinct text once); None when the client went away."""
    distinct = list(dict.fromkeys(text for pair in pairs for text in pair))
    prompt_tokens = sum(len(ids) for ids in distinct)
    request_log(request.scope).update(model=model_name, prompt_tokens=prompt_tokens,
                                      inputs=len(distinct), pairs=len(pairs))
    vectors = await embed_prompts(request, ctx, [list(ids) for ids in distinct], model_name,
                                  priority, kind)
    if vectors is None:
        return None
    row = {ids: i for i, ids in enumerate(distinct)}
    table = torch.tensor(vectors, dtype=torch.float64)  # [num_distinct, hidden_size]
    left = table[[row[a] for a, _ in pairs]]  # [num_pairs, hidden_size]
    right = table[[row[b] for _, b in pairs]]
    # The vectors are unit length already (PoolingParams.normalize); dividing by the norms
    # anyway keeps the score a cosine whatever the pooling config says.
    scores = torch.nn.functional.cosine_similarity(left, right, dim=-1)  # [num_pairs]
    return scores.tolist(), prompt_tokens
