"""`argosy serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) for one model.

    argosy serve --model smollm2-135m                      # http://127.0.0.1:8000
    argosy serve --model /models/llama --served-model-name llama-3-8b --host 0.0.0.0

Every engine option is a flag (from `EngineArgs`, the "engine" group below); the "server"
group holds the HTTP server's own (listen address, API key, queue bound, timeouts, tool-call
and reasoning parsers, runtime LoRA updates, Batch API folder, embedding pooling, chat and
score template, request body limit). SIGTERM
drains: /ready turns 503, running requests finish (up to --drain-timeout), exit 0. See
docs/server.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from argosy_runtime.engine_args import EngineArgs, parse_bytes_arg
from argosy_runtime.log_levels import add_log_level_argument
from argosy_runtime.server.config import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    EMBEDDING_POOLINGS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
)

T = TypeVar("T")

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C

if TYPE_CHECKING:
    from argosy_runtime.server.config import ServerConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="Serve a model over an OpenAI-compatible HTTP API.", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on (default: 127.0.0.1; 0.0.0.0 in a container).")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000).")
    server.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on every route but "
                             "/health, /ready, /metrics and the schema (/docs, /openapi.json) "
                             "(default: $ARGOSY_API_KEY, else no key).")
    server.add_argument("--max-waiting", type=int, default=1024,
                        help="Most requests waiting for the running batch (or for their "
                             "LoRA adapter, with --max-loaded-loras); more get 429 with "
                             "Retry-After. Counted per priority: a request waits only behind "
                             "those of its own or a more urgent priority, so less urgent ones "
                             "(batch requests) never keep it out (0: unbounded; default: "
                             "%(default)s).")
    server.add_argument("--request-timeout", type=float, default=600.0,
                        help="Seconds before a request is aborted (0: none; "
                             "default: %(default)s).")
    # A string default goes through parse_bytes like a typed value, and reads as written.
    server.add_argument("--max-request-body-size", type=parse_bytes_arg,
                        default=f"{DEFAULT_MAX_REQUEST_BODY_BYTES >> 20}MiB", metavar="BYTES",
                        help="Largest request body (e.g. 16MiB, 1e6, 0: no limit); a larger "
                             "one gets 413 before it is read. Batch API uploads (POST "
                             "/v1/files) have their own 200 MiB limit (default: %(default)s).")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="On SIGTERM, seconds to let running requests finish before "
                             "aborting them (default: %(default)s).")
    add_log_level_argument(server)
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="Read tool calls the model writes in this format and return them "
                             "as tool_calls (hermes: <tool_call>{json}</tool_call>, Qwen2.5 "
                             "and others; llama3_json: a reply that is {\"name\", "
                             "\"parameters\"} JSON, Llama 3.1+; mistral: [TOOL_CALLS] then "
                             "the calls, Mistral 7B v0.3, Small, Nemo; pythonic: a reply that "
                             "is a Python list of calls, Llama 3.2 / 4): enables tool_choice "
                             "'auto', also the default when a request has tools.")
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="The model's thinking format: chat replies then carry the text "
                             "between <think> and </think> in reasoning_content and only the "
                             "answer in content (qwen3: the model opens <think> itself, Qwen3 "
                             "and QwQ; deepseek_r1: the template opens it, DeepSeek-R1 and "
                             "Qwen3 *-Thinking-2507). Default: none, the reply is all content.")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="Accepted for vLLM compatibility (and, as there, an error "
                             "without --tool-call-parser); --tool-call-parser is what enables "
                             "tool_choice 'auto'.")
    server.add_argument("--allow-runtime-lora-updates", action="store_true",
                        help="Serve vLLM's POST /v1/load_lora_adapter and "
                             "/v1/unload_lora_adapter (off by default: they load any folder "
                             "a client names; protect them with --api-key).")
    server.add_argument("--batch-dir", default=None, metavar="DIR",
                        help="Folder for the Batch API's files and batches (/v1/files, "
                             "/v1/batches). On a persistent volume, a batch interrupted by a "
                             "restart resumes where it stopped; replicas sharing it (a "
                             "ReadWriteMany volume) see each other's files and batches and "
                             "take over the batches of a replica that stopped (default: a "
                             "temporary folder, removed at exit).")
    server.add_argument("--embedding-pooling", choices=EMBEDDING_POOLINGS, default=None,
                        help="How POST /v1/embeddings turns a prompt into one vector: the "
                             "final hidden state of its last token (last: how decoder "
                             "embedding models such as e5-mistral-7b-instruct and gte-Qwen2 are "
                             "trained), the mean over its tokens, the first token's (cls: "
                             "encoders such as BERT only), or sentence-transformers' max, "
                             "mean_sqrt_len_tokens, weightedmean; L2-normalized (default: the "
                             "model's own: last for a decoder; for an encoder, its "
                             "sentence-transformers pooling, else [CLS]).")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="A jinja chat template replacing the model's (vLLM's): the path "
                             "of a file, or the template itself on one line. Chat, /tokenize "
                             "and responses render with it; on a cross-encoder (a one-label "
                             "classification head, e.g. Qwen3-Reranker) it is the score "
                             "template /v1/score and /v1/rerank format each pair with, over "
                             "the messages [{role: query}, {role: document}] (default: the "
                             "tokenizer's own template, and pairs joined as vLLM joins them "
                             "without one).")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    # Until uvicorn installs its drain handler, Ctrl-C stops the start-up at once. As a
    # KeyboardInterrupt it was a traceback; while the model loaded the interpreter then
    # waited for the loading thread (minutes) and aborted ("terminate called without an
    # active exception"); raised inside an import, a library's bare `except:` could swallow
    # it and the server started anyway. Nothing needs cleaning up yet (tensor-parallel
    # workers exit with this process), so the handler leaves at once.
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    print("argosy serve: interrupted while starting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def _run(args: argparse.Namespace) -> int:
    from argosy_runtime.fleet.exit_with_parent import exit_with_parent_if_asked
    from argosy_runtime.server.config import ServerConfig  # noqa: F811 (runtime import)

    exit_with_parent_if_asked()  # a fleet's replica: not an orphan if the fleet is killed
    from argosy_runtime.tokenizer import load_chat_template

    try:
        if args.api_key is not None and not args.api_key.strip():
            # `--api-key "$KEY"` with KEY unset or empty: without this check the server
            # started without authentication (only a blank of spaces was refused).
            raise ValueError("--api-key is empty; leave it out to serve without a key")
        chat_template = (load_chat_template(args.chat_template)
                         if args.chat_template is not None else None)
        config = ServerConfig(
            host=args.host, port=args.port, api_key=ServerConfig.api_key_from_env(args.api_key),
            max_waiting=args.max_waiting, request_timeout=args.request_timeout,
            drain_timeout=args.drain_timeout, log_level=args.log_level,
            allow_runtime_lora_updates=args.allow_runtime_lora_updates,
            tool_call_parser=args.tool_call_parser, batch_dir=args.batch_dir,
            embedding_pooling=args.embedding_pooling, reasoning_parser=args.reasoning_parser,
            chat_template=chat_template, max_request_body_bytes=args.max_request_body_size)
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        engine_args = EngineArgs.from_cli_args(args)
        check_listen_address(config.host, config.port)
    except ValueError as exc:
        print(f"argosy serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return serve(engine_args, config)


def serve(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Load the model, then serve until SIGTERM/SIGINT has drained the server."""
    import uvicorn

    from argosy_runtime.distributed.workers import WorkerFailed
    from argosy_runtime.engine import LLMEngine
    from argosy_runtime.pooling_params import PoolingParams
    from argosy_runtime.server.app import build_app
    from argosy_runtime.server.lifecycle import DrainingServer

    log = logging.getLogger("argosy.server")
    try:
        engine = _off_main_thread(LLMEngine.from_engine_args, engine_args)
    except (ValueError, OSError) as exc:
        # OSError: a --model path that does not exist, an empty folder, an unreadable file
        # (FileNotFoundError from the loader): the user's mistake, one line, not a traceback.
        log.error("cannot load the model: %s", exc)
        return 2
    except WorkerFailed as exc:
        # Its message holds the worker's own traceback: what went wrong is there, and this
        # process's frames (a traceback through the loading thread) would only bury it.
        log.error("cannot load the model: %s", exc)
        return 1
    if config.embedding_pooling is not None:  # e.g. cls on a decoder: refused now, not per request
        try:
            engine.spec_pooling(PoolingParams(pooling=config.embedding_pooling))
        except ValueError as exc:
            log.error("--embedding-pooling %s: %s", config.embedding_pooling, exc)
            return 2
    app = build_app(engine, config)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=False,  # one structured line per request comes from our middleware
        timeout_keep_alive=30, timeout_graceful_shutdown=5, lifespan="on")
    ctx = app.state.ctx
    server = DrainingServer(uv_config, ctx.lifecycle, ctx.engine.abort_all)
    server.run()
    return 0


def check_listen_address(host: str, port: int) -> None:
    """ValueError naming --host or --port unless a server can listen on (host, port) now.

    Checked before the model loads: otherwise a mistyped host or a port already in use is
    only reported by uvicorn once loading (minutes for a large model) is done. Binds the way
    uvicorn (asyncio's create_server) does, with SO_REUSEADDR, so a port left in TIME_WAIT
    by a restarted server passes as it would there. Another process can still take the
    port in between; uvicorn then reports it (exit 3)."""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(f"--host {host!r} is not an address or a name this machine "
                         f"resolves ({reason})") from None
    family, socktype, proto, _, address = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there: "
                             f"{exc.strerror or exc}") from None


def _off_main_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run fn on a short-lived thread and return its result (or raise its exception).

    Loading the model runs parallel torch ops, and libgomp gives each thread that starts a
    parallel region its own OpenMP worker pool for as long as that thread lives. Loaded on
    the main thread, that pool would outlive loading beside the engine thread's own pool;
    libgomp then counts more OpenMP threads than CPUs and stops spin-waiting between
    parallel regions: a batch-1 decode step measured 30 ms on the main thread and 50 ms on
    the engine thread. A finished thread's pool goes away with it.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="argosy-load")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
