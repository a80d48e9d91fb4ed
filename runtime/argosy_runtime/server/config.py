"""`ServerConfig`: the HTTP-side options of `argosy serve` (the engine has `EngineArgs`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from argosy_runtime.log_levels import LOG_LEVELS
from argosy_runtime.pooling_params import POOLING_TYPES

# Tool-call formats for tool_choice "auto" (server/tool_parsers.py has one stream for each).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# How /v1/embeddings pools a prompt's hidden states: every PoolingParams pooling.
EMBEDDING_POOLINGS = POOLING_TYPES
# Thinking formats chat replies are split by (server/reasoning_parser.py).
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# Room for a 1M-token prompt as text (~4 MB) or as token ids (~7 MB); the gateway's own
# limit is 64 MiB (gateway/proxy/app.py).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Options of the OpenAI server around one engine.

    max_waiting: most requests waiting for a slot in the running batch before new ones get
        429 + Retry-After (0: unbounded); a new request counts only those of its own or a
        more urgent priority.
    request_timeout: seconds a request may take end to end before it is aborted (0: none).
    drain_timeout: seconds SIGTERM waits for running requests before aborting them.
    api_key: when set, /v1/* requires `Authorization: Bearer <key>`.
    allow_runtime_lora_updates: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter
        (off by default: they make the server read any folder a client names).
    tool_call_parser: the model's tool-call format (TOOL_CALL_PARSERS), for tool_choice
        "auto" (server/tool_parsers.py).
    batch_dir: where the Batch API keeps its files and batches; an unfinished batch resumes
        when the server starts again on the same folder (None: a temporary folder, removed
        at exit).
    embedding_pooling: how /v1/embeddings turns a prompt's hidden states into one vector:
        "last" (the last token's, as decoder embedding models such as e5-mistral and gte-Qwen2
        are trained), "mean", "cls" (encoders only), or sentence-transformers' "max",
        "mean_sqrt_len_tokens", "weightedmean" (pooling_params.py); None: the model's own (a
        decoder's last token; an encoder's sentence-transformers pooling, else [CLS]:
        `LLMEngine.spec_pooling`).
    reasoning_parser: the model's thinking format ("qwen3", "deepseek_r1"): chat replies then
        carry the thinking in `reasoning_content` and only the answer in `content`.
    chat_template: a jinja chat template replacing the tokenizer's (vLLM's --chat-template,
        already read from its file): chat, /tokenize and responses render with it, and a
        cross-encoder takes it as its score template (messages with roles "query" and
        "document"); None: the tokenizer's own, and no score template.
    max_request_body_bytes: a larger request body is a 413 before it is parsed (0: no
        limit); Batch API uploads (POST /v1/files) have their own 200 MiB limit.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting: int = 1024
    request_timeout: float = 600.0
    drain_timeout: float = 30.0
    log_level: str = "info"
    retry_after_s: int = 1
    allow_runtime_lora_updates: bool = False
    tool_call_parser: str | None = None
    batch_dir: str | None = None
    embedding_pooling: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0: unbounded), got {self.max_waiting}")
        # "not >= 0", not "< 0": NaN compares false with everything, and a NaN timeout
        # expires at once (asyncio): every request got 408, SIGTERM aborted without waiting.
        # inf is fine: no limit.
        if not self.request_timeout >= 0:
            raise ValueError(f"request_timeout must be >= 0, got {self.request_timeout}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_request_body_bytes < 0:
            raise ValueError("max_request_body_bytes must be >= 0 (0: no limit), "
                             f"got {self.max_request_body_bytes}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.log_level!r}")
        if self.api_key is not None:
            if not self.api_key.strip():
                raise ValueError("api_key must not be empty")
            # An HTTP header value has no leading or trailing whitespace (the server strips
            # it, clients refuse a newline in one), so a key with some could never match:
            # every request, the batch runner's own included, was a 401. Kubernetes hands
            # ARGOSY_API_KEY over so from a Secret made of a file ending in a newline.
            object.__setattr__(self, "api_key", self.api_key.strip())
            if not self.api_key.isascii():
                # Header bytes arrive decoded as latin-1: a non-ASCII key could never match
                # what a client sends (its UTF-8 bytes), so every request would be a 401.
                raise ValueError("api_key must be ASCII (HTTP header values are bytes; "
                                 "clients send a non-ASCII key as something else)")
        if self.embedding_pooling is not None and self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {', '.join(EMBEDDING_POOLINGS)}, "
                             f"got {self.embedding_pooling!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    @staticmethod
    def api_key_from_env(cli_value: str | None) -> str | None:
        """--api-key wins; otherwise ARGOSY_API_KEY (empty means no auth)."""
        if cli_value:
            return cli_value
        env_value = os.environ.get("ARGOSY_API_KEY")
        if env_value and not env_value.strip():
            # Refused here, not by __post_init__: its "api_key must not be empty" does not
            # say the blank came from the environment, not from a flag.
            raise ValueError("ARGOSY_API_KEY is only whitespace; unset it (or set it empty) "
                             "to serve without a key")
        return env_value or None
