"""POST /v1/score and POST /v1/rerank: vLLM's scoring APIs, for embedding (bi-encoder) and
cross-encoder models.

On a model without a classification head, a pair's score is the cosine similarity of the two
texts' pooled embeddings, what vLLM answers for an embedding model: each text runs as one
embedding request (`embed_prompts`, the same pooling, admission and priority as
/v1/embeddings), and each distinct text runs once however many pairs it is in (a rerank query
meets every document, but is embedded once). Any such model serves these: a generative model
has hidden states too.

On a sequence-classification checkpoint with one label (a decoder cross-encoder reranker,
or a causal LM read as one: Qwen3-Reranker's "yes" - "no" head), each pair is one prompt
(`scoring.cross_encoder_prompt`, as vLLM builds it): the score template (`--chat-template`)
rendered over the messages [{"role": "query"}, {"role": "document"}] when the server has
one, else the two texts joined by the tokenizer's pair template (transformers'
`tokenizer(text_1, text_2)`, with its token types: BERT's second text is type 1) or, for
`use_sep_token: false` (an LLM reranker's default), as text_1 + text_2; it runs as a classify
request and the score is the sigmoid of the head's logit. `truncate_prompt_tokens` cuts each
pair's prompt from its end, as vLLM does (the query stays, the document loses its end). A classifier with more labels is no scorer (vLLM enables scoring only for one label):
400 naming `model`.

`/v1/score` pairs `text_1` with `text_2`: 1-to-1, 1-to-N (one `text_1` against every
`text_2`) or N-to-N (equal lengths, pair by pair). `/v1/rerank` (also `/rerank`, and Cohere's
`/v2/rerank`) is Jina's and Cohere's schema as vLLM serves it: `query` against `documents`,
sorted by relevance, the first `top_n`.
"""

from __future__ import annotations

import time
from typing import Any

from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.scoring import (
    cosine_scores,
    cross_encoder_max_length,
    cross_encoder_prompt,
    cross_encoder_score,
    pair_up,
)
from argosy_runtime.server.errors import APIError, bad_request
from argosy_runtime.server.protocol import new_id
from argosy_runtime.server.request_log import request_log
from argosy_runtime.server.serving_common import (
    ServingContext,
    check_text_fits,
    check_truncate_prompt_tokens,
    run_tokenizer,
    truncate_prompts,
)
from argosy_runtime.server.serving_completion import normalize_prompts
from argosy_runtime.server.serving_embedding import (
    MAX_EMBEDDING_INPUTS,
    embed_prompts,
    pool_prompts,
)
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
    if ctx.class_labels:
        firsts, seconds = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
        scored = await _cross_encoder_scores(request, ctx, model_name, req.priority, "score",
                                             _pair_up(firsts, seconds),
                                             req.truncate_prompt_tokens, ("text_1", "text_2"))
    else:
        firsts = await _tokenize(ctx, req.text_1, "text_1", req.truncate_prompt_tokens)
        seconds = await _tokenize(ctx, req.text_2, "text_2", req.truncate_prompt_tokens)
        scored = await _cosine_scores(request, ctx, model_name, req.priority, "score",
                                      _pair_up(firsts, seconds))
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
    if ctx.class_labels:
        documents = _texts(req.documents, "documents")
        scored = await _cross_encoder_scores(request, ctx, model_name, req.priority, "rerank",
                                             [(req.query, d) for d in documents],
                                             req.truncate_prompt_tokens, ("query", "documents"))
    else:
        [query] = await _tokenize(ctx, req.query, "query", req.truncate_prompt_tokens)
        documents = await _tokenize(ctx, req.documents, "documents", req.truncate_prompt_tokens)
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


def _pair_up(firsts: list[Any], seconds: list[Any]) -> list[tuple[Any, Any]]:
    """/v1/score's pairing (scoring.pair_up), its ValueError a 400 naming text_2."""
    try:
        return pair_up(firsts, seconds)
    except ValueError as exc:
        raise bad_request(str(exc), "text_2") from exc


async def _tokenize(ctx: ServingContext, texts: str | list[str], param: str,
                    truncate: int | None) -> list[tuple[int, ...]]:
    """Each text's token ids (tuples: they key the de-duplication), truncated on the left
    as vLLM's `truncate_prompt_tokens` does, then checked like an embeddings input."""
    _, prompts = await normalize_prompts(ctx, texts, param, MAX_EMBEDDING_INPUTS, truncate)
    return [tuple(ids) for ids in truncate_prompts(ctx, prompts, truncate, param)]


def _texts(texts: str | list[str], param: str) -> list[str]:
    """A cross-encoder's texts, as given (each pair is tokenized together)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise bad_request(f"{param} must not be empty", param)
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"{param}: at most {MAX_EMBEDDING_INPUTS} items per request", param)
    return texts


async def _cross_encoder_scores(request: Request, ctx: ServingContext, model_name: str,
                                priority: int, kind: str, pairs: list[tuple[str, str]],
                                truncate: int | None, fields: tuple[str, str]
                                ) -> tuple[list[float], int] | None:
    """sigmoid(the head's logit) of each pair run as one prompt, and the prompt tokens run
    (each distinct prompt once); None when the client went away. `fields`: the request's
    names for the pair's first and second texts, for the 400s."""
    param = fields[1]
    if len(ctx.class_labels) != 1:
        raise bad_request(
            f"model: {model_name} is a classifier with {len(ctx.class_labels)} labels; scores "
            "need a one-label head (a cross-encoder) or an embedding model", "model")
    # Every pair's prompt is cut as vLLM cuts it, by transformers' tokenizer(...,
    # truncation=True, max_length=k): from the end, so the query stays and the document
    # loses its end (a pair template: the longer text first; the special tokens stay).
    check_truncate_prompt_tokens(ctx, truncate)  # the server's 400; the rest pydantic checked
    if not truncate:
        # A pair with more characters than the model's length can hold in tokens is too long
        # whatever its tokenization: refused before tokenizing, as an embeddings input is
        # (each pair is tokenized whole, so a long query would be once per document).
        a, b = max(pairs, key=lambda pair: len(pair[0]) + len(pair[1]))
        check_text_fits(ctx, a + b, fields[0] if len(a) > len(b) else fields[1])
    limit = cross_encoder_max_length(truncate, ctx.max_model_len)
    spec = ctx.engine.engine.spec
    def join_pairs() -> list[Any]:
        return [cross_encoder_prompt(ctx.tokenizer, a, b, use_sep_token=ctx.use_sep_token,
                                     score_template=ctx.config.chat_template,
                                     max_length=limit, token_types=spec.takes_token_types)
                for a, b in pairs]

    try:
        joined = await run_tokenizer(sum(len(a) + len(b) for a, b in pairs), join_pairs)
    except ValueError as exc:  # a score template that raises (raise_exception) on this pair
        field = "truncate_prompt_tokens" if str(exc).startswith("truncate_prompt_tokens") \
            else param
        raise bad_request(str(exc), field) from exc
    for (a, b), prompt in zip(pairs, joined, strict=True):
        if len(prompt.token_ids) > ctx.max_model_len:
            raise await _pair_too_long(ctx, a, b, len(prompt.token_ids), fields)
    # Checked (vocabulary, length) as any pooling input; the token types key the pair too.
    checked = truncate_prompts(ctx, [p.token_ids for p in joined], None, param)
    prompts = [(tuple(ids), p.token_type_start) for ids, p in zip(checked, joined, strict=True)]
    distinct = list(dict.fromkeys(prompts))
    prompt_tokens = sum(len(ids) for ids, _ in distinct)
    request_log(request.scope).update(model=model_name, prompt_tokens=prompt_tokens,
                                      inputs=len(distinct), pairs=len(pairs))
    finals = await pool_prompts(
        request, ctx, [list(ids) for ids, _ in distinct], model_name, priority, kind,
        [PoolingParams(task="classify", token_type_start=start) for _, start in distinct])
    if finals is None:
        return None
    activation = ctx.engine.engine.spec.score_activation
    score = {key: cross_encoder_score(out.classification.logits, activation)
             for key, out in zip(distinct, finals, strict=True)}
    return [score[key] for key in prompts], prompt_tokens


async def _pair_too_long(ctx: ServingContext, text_1: str, text_2: str, num_tokens: int,
                         fields: tuple[str, str]) -> APIError:
    """The 400 for a pair whose joined prompt is over the model's length. It names the field
    of the pair's longer text, the one to shorten (either may be: a long query is as much
    too long as a long document), and gives both texts' lengths."""
    n_1, n_2 = await run_tokenizer(len(text_1) + len(text_2), lambda: [
        len(ctx.tokenizer.encode(t, add_special_tokens=False)) for t in (text_1, text_2)])
    return bad_request(
        f"this model's maximum context length is {ctx.max_model_len} tokens; the pair's "
        f"prompt has {num_tokens} tokens ({fields[0]}: {n_1}, {fields[1]}: {n_2})",
        fields[0] if n_1 > n_2 else fields[1], code="context_length_exceeded")


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
    return cosine_scores(vectors, [(row[a], row[b]) for a, b in pairs]), prompt_tokens
