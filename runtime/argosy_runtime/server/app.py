"""The FastAPI application: OpenAI routes, probes and metrics around one `AsyncEngine`."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from argosy_runtime.async_engine import AsyncEngine
from argosy_runtime.server.batch.batch_runner import BatchRunner
from argosy_runtime.server.batch.file_store import FileStore
from argosy_runtime.server.batch.routes import add_batch_routes
from argosy_runtime.server.body_limit import BodySizeLimitMiddleware
from argosy_runtime.server.config import ServerConfig
from argosy_runtime.server.errors import install_error_handlers
from argosy_runtime.server.lifecycle import Lifecycle
from argosy_runtime.server.lora_admin import LoRAAdmin
from argosy_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from argosy_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from argosy_runtime.server.request_body import StrictJSONRoute
from argosy_runtime.server.request_log import RequestContextMiddleware
from argosy_runtime.server.responses import BackgroundRuns, ResponseStore, add_responses_routes
from argosy_runtime.server.serving_chat import create_chat_completion
from argosy_runtime.server.serving_classify import ClassifyRequest, create_classify
from argosy_runtime.server.serving_common import ServingContext
from argosy_runtime.server.serving_completion import create_completion
from argosy_runtime.server.serving_embedding import create_embedding
from argosy_runtime.server.serving_score import (
    RerankRequest,
    ScoreRequest,
    create_rerank,
    create_score,
)
from argosy_runtime.server.serving_tokenize import detokenize, tokenize
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

logger = logging.getLogger("argosy.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 429, 503)}


def _apply_chat_template(engine: Any, config: ServerConfig) -> None:
    """--chat-template replaces the tokenizer's template (chat, /tokenize, responses), as in
    vLLM. An LLM reranker (a head made of lm_head rows) without one scores text_1 + text_2 as
    is, which is rarely the prompt it was trained on: say so."""
    if config.chat_template is not None:
        engine.tokenizer.chat_template = config.chat_template
    elif engine.spec.classifier_method:
        logger.warning(
            "%s is an LLM reranker (classifier_from_token %s) served without --chat-template: "
            "/v1/score and /v1/rerank score text_1 + text_2 as is; pass the model's prompt "
            "format as a score template (docs/server.md, Scores and reranking, has "
            "Qwen3-Reranker's)", engine.served_model_name,
            list(engine.spec.classifier_from_token))


def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """An app serving `engine` (an `LLMEngine`); the engine thread starts with the app."""
    model_name = engine.served_model_name
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, observer=metrics, max_waiting=config.max_waiting,
                               max_num_seqs=_max_num_seqs(engine))
    lifecycle = Lifecycle(config.drain_timeout)
    lora = LoRAAdmin(engine, config.allow_runtime_lora_updates)
    metrics.attach_engine(lambda: async_engine.stats, lambda: async_engine.num_waiting,
                          _cache_info(engine), lora.loaded_names, lora.names, lora.num_loads,
                          lambda: async_engine.is_alive)
    ctx = ServingContext(engine=async_engine, tokenizer=engine.tokenizer, model_name=model_name,
                         max_model_len=int(engine.max_model_len), config=config,
                         lifecycle=lifecycle, metrics=metrics, adapter_names=lora.names,
                         embedding_size=engine.spec.hidden_size,
                         class_labels=engine.spec.id2label,
                         use_sep_token=engine.spec.use_sep_token,
                         encoder=engine.spec.is_encoder,
                         end_token_ids=engine.end_token_ids)
    _apply_chat_template(engine, config)
    # Without --batch-dir, batches live in a temporary folder removed at exit.
    batch_root = Path(config.batch_dir or tempfile.mkdtemp(prefix="argosy-batches-"))
    files = FileStore(batch_root)
    background = BackgroundRuns()  # background responses (their tasks outlive requests)
    lifecycle.on_drain_timeout.append(background.interrupt)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        lifecycle.started = True
        logger.info("serving %s (max_model_len %d)", model_name, ctx.max_model_len)
        try:
            await batches.start()
            async with lora.watching_modules_file():
                yield
        finally:
            lifecycle.started = False
            await batches.shutdown()
            await background.shutdown()  # after a drain none runs; else cut them short
            if config.batch_dir is None:
                shutil.rmtree(batch_root, ignore_errors=True)
            async_engine.abort_all()
            async_engine.shutdown()

    app = FastAPI(title="Argosy OpenAI-compatible server", version="0.1.0", lifespan=lifespan)
    app.router.route_class = StrictJSONRoute  # a lone surrogate in a body is a 400, not a 500
    app.state.ctx = ctx
    install_error_handlers(app)
    batches = BatchRunner(batch_root, files, app, concurrency=_max_num_seqs(engine) or 64,
                          api_key=config.api_key, is_draining=lambda: lifecycle.draining)
    add_batch_routes(app, files, batches)
    metrics.batch_pending.set_function(batches.num_pending)
    # Added first, so it runs inside RequestContextMiddleware: a 413 is authenticated first,
    # logged and counted like any other answer.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       upload_max_bytes=files.max_bytes)
    app.add_middleware(RequestContextMiddleware, api_key=config.api_key,
                       on_response=metrics.on_http)

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await create_completion(request, body, ctx)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await create_chat_completion(request, body, ctx)

    @app.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(request: Request, body: EmbeddingRequest) -> Response:
        return await create_embedding(request, body, ctx)

    # vLLM serves these under both prefixes; Cohere's client posts to /v2/rerank.
    @app.post("/v1/classify", responses=_ERRORS)
    @app.post("/classify", responses=_ERRORS)
    async def classify(request: Request, body: ClassifyRequest) -> Response:
        return await create_classify(request, body, ctx)

    @app.post("/v1/score", responses=_ERRORS)
    @app.post("/score", responses=_ERRORS)
    async def score(request: Request, body: ScoreRequest) -> Response:
        return await create_score(request, body, ctx)

    @app.post("/v1/rerank", responses=_ERRORS)
    @app.post("/rerank", responses=_ERRORS)
    @app.post("/v2/rerank", responses=_ERRORS)
    async def rerank(request: Request, body: RerankRequest) -> Response:
        return await create_rerank(request, body, ctx)

    add_responses_routes(app, ctx, ResponseStore(), background)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(body, ctx)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(body, ctx)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        return await lora.load(body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        return await lora.unload(body.lora_name)

    def model_card(name: str) -> dict[str, Any]:
        """The model object of a served name: the base model, or a LoRA adapter (a model
        too, listed with its parent as vLLM lists it)."""
        base = {"id": model_name, "object": "model", "created": ctx.created,
                "owned_by": "argosy", "max_model_len": ctx.max_model_len}
        return base if name == model_name else {**base, "id": name, "parent": model_name}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [model_card(name) for name in (model_name, *ctx.lora_names)]}

    # `:path`: a served name may hold slashes ("org/model"; the openai client sends %2F).
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str) -> dict[str, Any]:
        # Unknown (or unloaded adapter): the 404 model_not_found a request naming it gets.
        return model_card(ctx.check_model(model))

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the process and its engine thread are alive."""
        if not async_engine.is_alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the model is loaded and the server is not draining."""
        if lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not (lifecycle.ready and async_engine.is_alive):
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _cache_info(engine: Any) -> dict[str, str]:
    try:
        info = engine.cache_config_info()
    except AttributeError:
        info = {}
    return {str(k): str(v) for k, v in info.items()}


def _max_num_seqs(engine: Any) -> int | None:
    """The running-batch size, if the engine exposes it (LLMEngine keeps its EngineArgs)."""
    for owner in (getattr(engine, "scheduler_config", None), getattr(engine, "args", None)):
        value = getattr(owner, "max_num_seqs", None)
        if isinstance(value, int):
            return value
    return None
