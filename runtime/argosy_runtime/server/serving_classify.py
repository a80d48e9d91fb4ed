"""POST /v1/classify (also /classify): vLLM's classification API for sequence-classification
checkpoints (`*ForSequenceClassification`: classifiers, reward models, cross-encoders).

Each input runs as one classify request (PoolingParams(task="classify"): the head's logits at
the last token) through `pool_prompts`, the admission, drain accounting and 499 handling
/v1/embeddings uses. Each answer is vLLM's: the most probable `label` (config.json
`id2label`), `probs` (softmax over the labels; sigmoid for a one-label head) and
`num_classes`. A model without a classification head answers 400 naming `model`.
"""

from __future__ import annotations

from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.server.errors import bad_request
from argosy_runtime.server.protocol import new_id, now
from argosy_runtime.server.request_log import request_log
from argosy_runtime.server.serving_common import ServingContext, truncate_prompts
from argosy_runtime.server.serving_completion import normalize_prompts
from argosy_runtime.server.serving_embedding import (
    MAX_EMBEDDING_INPUTS,
    pool_prompts,
)
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response


class ClassifyRequest(BaseModel):
    """POST /v1/classify (vLLM's, text or token-id inputs)."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400, as on every route
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # vLLM's: keep the last k tokens of each input; -1: the model's length; 0: all.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    user: str | None = None
    priority: StrictInt = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)


def check_classifier(ctx: ServingContext, model_name: str, route: str) -> None:
    """400 naming `model` unless the served checkpoint has a classification head."""
    if not ctx.class_labels:
        raise bad_request(f"model: {model_name} has no classification head (not a "
                          f"*ForSequenceClassification checkpoint): {route} needs one", "model")


async def create_classify(request: Request, req: ClassifyRequest, ctx: ServingContext
                          ) -> Response:
    ctx.check_accepting()
    model_name = ctx.check_model(req.model)
    check_classifier(ctx, model_name, "/v1/classify")
    _, prompts = await normalize_prompts(ctx, req.input, "input", MAX_EMBEDDING_INPUTS,
                                         req.truncate_prompt_tokens)
    prompts = truncate_prompts(ctx, prompts, req.truncate_prompt_tokens, "input")
    prompt_tokens = sum(len(p) for p in prompts)
    request_log(request.scope).update(model=model_name, prompt_tokens=prompt_tokens,
                                      inputs=len(prompts))
    finals = await pool_prompts(request, ctx, prompts, model_name, req.priority, "classify",
                                PoolingParams(task="classify"))
    if finals is None:
        return Response(status_code=499)
    data = []
    for i, out in enumerate(finals):
        result = out.classification
        data.append({"index": i, "label": result.label, "probs": result.probs,
                     "num_classes": result.num_classes})
    return JSONResponse({
        "id": new_id("classify"), "object": "list", "created": now(), "model": model_name,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    })
