"""What the engine returns per request and step (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled/actual token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the n sequences of a request; fields are cumulative since the request began."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # "stop" | "length" | "abort" | "error" | None while running; "error": the sequence failed
    # mid-generation (its structured-output grammar hit a matcher limit), `error` says why
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ClassificationOutput:
    """What a classify request (PoolingParams(task="classify")) returns: the head's `logits`
    at the last token, `probs` and `label`, the most probable class's name (config.json
    `id2label`). `probs` as transformers' text-classification pipeline makes them from
    config.json `problem_type`: the softmax over the labels; for a one-label head (a reward
    model, a cross-encoder; vLLM's classify activation too) or a multi-label one, each
    logit's sigmoid (a softmax would make independent labels compete); a regression head's
    values as they are."""

    logits: list[float]
    probs: list[float]
    label: str

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @classmethod
    def from_logits(cls, logits: list[float], labels: tuple[str, ...],
                    problem_type: str | None = None) -> ClassificationOutput:
        import torch  # here, not at the top: outputs.py is plain dataclasses, light to import

        values = torch.tensor(logits, dtype=torch.float32)
        if problem_type == "regression":
            probs = values
        elif problem_type == "multi_label_classification" or len(logits) == 1:
            probs = values.sigmoid()
        else:
            probs = values.softmax(dim=0)
        return cls(logits=list(logits), probs=probs.tolist(),
                   label=labels[int(probs.argmax())])


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    `outputs[i].token_ids` / `.text` are cumulative; a streaming caller diffs against what it
    already sent. `finished` is True once every sequence has a finish_reason. A pooling
    request (PoolingParams) has no `outputs`; its single, finished output holds `embedding`
    (task "embed") or `classification` (task "classify").
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None
    classification: ClassificationOutput | None = None


@dataclass
class EngineStats:
    """A snapshot for metrics: gauges now, counters since start."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)  # priority -> count
    kv_cache_usage: float = 0.0  # 0..1, cached-but-unreferenced blocks count as free
    num_gpu_blocks: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)
