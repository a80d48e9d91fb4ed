"""A small real HTTP server speaking the runtime server's contract (OpenAI + /metrics shapes).

It stands in for `argosy serve` in the gateway's unit tests only: it answers in milliseconds,
and each instance can be told to fail in the ways the gateway must survive (refuse, 5xx, 429
with Retry-After, stall before the first byte, go unready). End-to-end tests use real servers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

KNOWN_FIELDS = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "stream", "stop", "n", "logprobs", "top_logprobs", "seed", "ignore_eos",
    "stream_options", "presence_penalty", "frequency_penalty", "user", "priority", "cache_salt",
    "prompt_cache_key",  # chat only on the server; the fake takes it on both
    "tools",
}
# The server's embeddings fields (OpenAI's and `priority`): anything else is refused, as there.
EMBEDDINGS_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "priority"}
EMBEDDING_DIMENSIONS = 4
# The server's /v1/score and /v1/rerank fields (vLLM's, plus Jina's `return_documents`).
SCORE_FIELDS = {"model", "text_1", "text_2", "truncate_prompt_tokens", "priority"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents",
                 "truncate_prompt_tokens", "priority"}
CLASSIFY_FIELDS = {"model", "input", "truncate_prompt_tokens", "user", "priority"}


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status=status,
    )


class Served:
    """Serving an aiohttp app on a loopback port (`url`), and stopping or killing it: shared by
    the fake replicas of the gateway's tests."""

    url: str
    _runner: web.AppRunner | None

    async def _serve(self, app: web.Application, port: int = 0) -> str:
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.2
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{bound}"
        return self.url

    async def kill(self) -> None:
        """Die like a killed process: every open connection is cut, then the port closes."""
        if self._runner is not None and self._runner.server is not None:
            for handler in list(self._runner.server.connections):
                if handler.transport is not None:
                    handler.transport.abort()
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@dataclass
class FakeReplica(Served):
    """One fake replica; knobs change its behaviour between requests."""

    model: str = "tiny"
    adapters: list[str] = field(default_factory=list)  # LoRA adapter names on `model`
    # Served but not loaded (a runtime with --max-loaded-loras): listed in /v1/models and
    # argosy:lora_adapter_registered only.
    registered_adapters: list[str] = field(default_factory=list)
    name: str = "r"
    # Gauges served on /metrics.
    kv_cache_usage: float = 0.0
    num_waiting: int = 0
    batch_pending: int = 0
    # Failure knobs.
    fail_next: int = 0  # answer this many requests with `fail_status`
    fail_status: int = 500
    fail_retry_after: int | None = None
    rate_limited: float | None = None  # answer 429 with this Retry-After while set
    ready: bool = True
    healthy: bool = True  # False: /health answers 503, as a server whose engine died
    metrics_status: int = 200  # not 200: /metrics answers this status, with no metrics
    first_byte_delay: float = 0.0  # after the headers, before the first body byte
    chunk_delay: float = 0.01
    models_delay: float = 0.0  # before answering /v1/models
    num_chunks: int = 4
    logprob: float = -0.1  # per-token logprob reported when asked
    prompt_tokens: int = 10  # the usage reported: this many prompt tokens, one per chunk
    # Records.
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[Any] = field(default_factory=list)
    disconnects: int = 0
    completed: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    _seen_prefixes: set[str] = field(default_factory=set)
    url: str = ""
    _runner: web.AppRunner | None = None

    def text_of(self, i: int) -> str:
        return f"{self.name}-tok{i} "

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/embeddings", self._embeddings)
        for path in ("/v1/score", "/score"):
            app.router.add_post(path, self._score)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, self._rerank)
        for path in ("/v1/classify", "/classify"):
            app.router.add_post(path, self._classify)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/control", self._control)  # test-only: set knobs from outside
        return await self._serve(app, port)

    async def _control(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            setattr(self, key, value)
        return web.json_response({"ok": True})

    async def _models(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.models_delay)
        base = {"id": self.model, "object": "model", "owned_by": "argosy"}
        adapters = [{**base, "id": name, "parent": self.model}
                    for name in (*self.adapters, *self.registered_adapters)]
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"status": "engine dead"}, status=503)
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="metrics failed")
        text = (
            "# TYPE argosy:kv_cache_usage_perc gauge\n"
            f'argosy:kv_cache_usage_perc{{model_name="{self.model}"}} {self.kv_cache_usage}\n'
            "# TYPE argosy:num_requests_waiting gauge\n"
            f'argosy:num_requests_waiting{{model_name="{self.model}"}} {self.num_waiting}\n'
            "# TYPE argosy:num_requests_running gauge\n"
            f'argosy:num_requests_running{{model_name="{self.model}"}} 0\n'
            "# TYPE argosy:batch_requests_pending gauge\n"
            f'argosy:batch_requests_pending{{model_name="{self.model}"}} {self.batch_pending}\n'
            "# TYPE argosy:request_success counter\n"
            f'argosy:request_success_total{{model_name="{self.model}",finished_reason="length"}} '
            f"{self.completed}\n"
            "# TYPE argosy:prefix_cache_queries counter\n"
            f'argosy:prefix_cache_queries_total{{model_name="{self.model}"}} {self.prefix_queries}\n'
            "# TYPE argosy:prefix_cache_hits counter\n"
            f'argosy:prefix_cache_hits_total{{model_name="{self.model}"}} {self.prefix_hits}\n'
            "# TYPE argosy:lora_adapter_loaded gauge\n"
            + "".join(f'argosy:lora_adapter_loaded{{model_name="{self.model}",lora_name="{a}"}} 1\n'
                      for a in self.adapters)
            + ("# TYPE argosy:lora_adapter_registered gauge\n" if self.registered_adapters
               else "")
            + "".join(f'argosy:lora_adapter_registered{{model_name="{self.model}",'
                      f'lora_name="{a}"}} 1\n'
                      for a in (*self.adapters, *self.registered_adapters)
                      if self.registered_adapters)
        )
        return web.Response(text=text, content_type="text/plain")

    async def _read_request(self, request: web.Request, known_fields: set[str],
                            default_model: str | None = None
                            ) -> tuple[dict[str, Any], web.Response | None]:
        """The body, recorded, and the error a replica answers for it (None if none):
        malformed JSON, an unknown field, a model it does not serve."""
        try:
            body = json.loads(await request.read())
        except json.JSONDecodeError:
            return {}, _error(400, "Invalid JSON", "BadRequestError")
        self.requests.append(body)
        self.headers_seen.append(request.headers.copy())
        unknown = sorted(set(body) - known_fields)
        if unknown:
            return body, _error(400, f"Unknown field(s): {unknown}", "BadRequestError",
                                unknown[0])
        if body.get("model", default_model) not in (self.model, *self.adapters,
                                                    *self.registered_adapters):
            return body, _error(404, f"The model `{body.get('model')}` does not exist.",
                                "NotFoundError", "model")
        return body, None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, refusal = await self._read_request(request, KNOWN_FIELDS)
        if refusal is not None:
            return refusal
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, int | float) or temperature < 0:
            return _error(400, "temperature must be >= 0", "BadRequestError", "temperature")
        failure = self._injected_failure()
        if failure is not None:
            return failure
        # A toy prefix cache: the first 32 characters of the prompt.
        is_chat = request.path.endswith("/chat/completions")
        prompt = json.dumps(body.get("messages")) if is_chat else str(body.get("prompt"))
        self.prefix_queries += 1
        if prompt[:32] in self._seen_prefixes:
            self.prefix_hits += 1
        self._seen_prefixes.add(prompt[:32])
        if body.get("stream"):
            return await self._stream(request, body, is_chat)
        try:
            await asyncio.sleep(self.first_byte_delay + self.chunk_delay * self.num_chunks)
            text = "".join(self.text_of(i) for i in range(self.num_chunks))
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": text}
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "content": [{"token": "t", "logprob": self.logprob}] * self.num_chunks
                    }
            else:
                choice["text"] = text
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"token_logprobs": [self.logprob] * self.num_chunks}
            self.completed += 1
            return web.json_response(
                {"id": "x", "object": "chat.completion" if is_chat else "text_completion",
                 "created": int(time.time()), "model": self.model, "choices": [choice],
                 "usage": self._usage()}
            )
        except asyncio.CancelledError:
            self.disconnects += 1
            raise

    def _injected_failure(self) -> web.Response | None:
        """The failure the knobs ask for (`fail_next`, `rate_limited`), else None."""
        if self.fail_next > 0:
            self.fail_next -= 1
            resp = _error(self.fail_status, "injected failure", "InternalServerError")
            if self.fail_retry_after is not None:
                resp.headers["Retry-After"] = str(self.fail_retry_after)
            return resp
        if self.rate_limited is not None:
            resp = _error(429, "queue full", "RateLimitError")
            resp.headers["Retry-After"] = str(int(self.rate_limited))
            return resp
        return None

    async def _embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's embeddings: one vector per input (made of its index), floats or base64
        (little-endian float32 bytes), with prompt tokens only in `usage`."""
        body, refusal = await self._read_request(request, EMBEDDINGS_FIELDS, self.model)
        if refusal is not None:
            return refusal
        failure = self._injected_failure()
        if failure is not None:
            return failure
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                        and all(isinstance(t, int) for t in inputs)):
            inputs = [inputs]  # one string, or one token-id input
        if not isinstance(inputs, list) or not inputs:
            return _error(400, "input must be a string or a non-empty list", "BadRequestError",
                          "input")
        # The toy prefix cache, as for completions: the first input speaks for the batch.
        self.prefix_queries += 1
        if str(inputs[0])[:32] in self._seen_prefixes:
            self.prefix_hits += 1
        self._seen_prefixes.add(str(inputs[0])[:32])
        dimensions = body.get("dimensions") or EMBEDDING_DIMENSIONS
        data = []
        for index in range(len(inputs)):
            vector = [index + d / 8 for d in range(dimensions)]  # exact in float32
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        self.completed += 1
        tokens = self.prompt_tokens * len(inputs)
        return web.json_response({"object": "list", "data": data,
                                  "model": body.get("model", self.model),
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _score(self, request: web.Request) -> web.Response:
        """vLLM's score answer: one score per text_2 (made of its index), prompt tokens only
        in `usage` (`prompt_tokens` per text sent)."""
        body, refusal = await self._read_request(request, SCORE_FIELDS, self.model)
        if refusal is not None:
            return refusal
        failure = self._injected_failure()
        if failure is not None:
            return failure
        texts = [t if isinstance(t, list) else [t] for t in (body["text_1"], body["text_2"])]
        data = [{"index": i, "object": "score", "score": 1 / (i + 1)}
                for i in range(len(texts[1]))]
        tokens = self.prompt_tokens * (len(texts[0]) + len(texts[1]))
        self.completed += 1
        return web.json_response({"id": "score-x", "object": "list", "created": 0,
                                  "model": body.get("model", self.model), "data": data,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                            "completion_tokens": 0}})

    async def _classify(self, request: web.Request) -> web.Response:
        """vLLM's classify answer: two labels per input, prompt tokens only in `usage`."""
        body, refusal = await self._read_request(request, CLASSIFY_FIELDS, self.model)
        if refusal is not None:
            return refusal
        failure = self._injected_failure()
        if failure is not None:
            return failure
        inputs = body["input"]
        if not isinstance(inputs, list) or all(isinstance(t, int) for t in inputs):
            inputs = [inputs]
        data = [{"index": i, "label": "LABEL_0", "probs": [0.75, 0.25], "num_classes": 2}
                for i in range(len(inputs))]
        tokens = self.prompt_tokens * len(inputs)
        self.completed += 1
        return web.json_response({"id": "classify-x", "object": "list", "created": 0,
                                  "model": body.get("model", self.model), "data": data,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                            "completion_tokens": 0}})

    async def _rerank(self, request: web.Request) -> web.Response:
        """Jina's rerank answer, documents in the order sent (relevance 1, 1/2, ...)."""
        body, refusal = await self._read_request(request, RERANK_FIELDS, self.model)
        if refusal is not None:
            return refusal
        failure = self._injected_failure()
        if failure is not None:
            return failure
        docs = body["documents"]
        results = [{"index": i, "document": {"text": d}, "relevance_score": 1 / (i + 1)}
                   for i, d in enumerate(docs)][: body.get("top_n") or None]
        tokens = self.prompt_tokens * (1 + len(docs))
        self.completed += 1
        return web.json_response({"id": "rerank-x", "model": body.get("model", self.model),
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                                  "results": results})

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.num_chunks,
                "total_tokens": self.prompt_tokens + self.num_chunks}

    async def _stream(self, request: web.Request, body: dict[str, Any], is_chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # headers go out at once, like a real SSE server
        try:
            await asyncio.sleep(self.first_byte_delay)
            for i in range(self.num_chunks):
                if is_chat:
                    delta = {"index": 0, "delta": {"content": self.text_of(i)}, "finish_reason": None}
                else:
                    delta = {"index": 0, "text": self.text_of(i), "finish_reason": None}
                event = {"id": "x", "model": self.model, "choices": [delta]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(self.chunk_delay)
            if (body.get("stream_options") or {}).get("include_usage"):
                event = {"id": "x", "model": self.model, "choices": [], "usage": self._usage()}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        return resp


def main() -> None:
    """Run as a process with `argosy serve`'s flags (the fleet's tests start it so)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()

    async def serve() -> None:
        replica = FakeReplica(model=args.served_model_name or args.model, name=f"p{args.port}")
        await replica.start(port=args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)  # drain: nothing long runs here
        await stop.wait()
        await replica.stop()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
