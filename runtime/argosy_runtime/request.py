"""One sequence being generated, as the scheduler and engine see it."""

from __future__ import annotations

import enum
import hashlib
import time
from typing import TYPE_CHECKING

from argosy_runtime.outputs import PositionLogprobs, RequestMetrics
from argosy_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from argosy_runtime.detokenizer import IncrementalDetokenizer
    from argosy_runtime.lora import LoRAAdapter
    from argosy_runtime.pooling_params import PoolingParams
    from argosy_runtime.structured_output.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # the request failed mid-generation (its structured-output grammar hit a matcher limit):
    # `Request.error` says why; vLLM's FinishReason.ERROR
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class Request:
    """A prompt plus its growing output.

    `token_ids` is prompt + output. `num_computed_tokens` counts tokens whose K/V are in the
    cache; a running decode has `num_computed_tokens == num_tokens - 1` (the last sampled token
    is fed in the next step).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        index: int = 0,
        parent_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index  # position among the parent's n sequences
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first schedule; -1 = unset
        self.prompt_counted = False  # in the engine's prompt_tokens (once, preempted or not)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it ended FINISHED_ERROR
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.generator: torch.Generator | None = None  # per-request RNG when params.seed is set
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""  # output text (stop strings already applied)
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step
        self.grammar: RequestGrammar | None = None  # set when params.structured_outputs is
        self.lora: LoRAAdapter | None = None  # the adapter this request runs with, if any
        # ((adapter salt, cache_salt), their hash): `cache_salt` computed once
        self._salt_seed: tuple[tuple[int | None, str], int] | None = None
        # Set for a pooling request: it runs its prompt, samples nothing, and finishes with
        # `pooled`, its embedding or (task "classify") its head logits (pooler.py;
        # `pooled_state` is the running float32 sum or maximum of the poolings over every
        # token: mean, max, mean_sqrt_len_tokens, weightedmean).
        self.pooling: PoolingParams | None = None
        self.pooled_state: torch.Tensor | None = None
        self.pooled: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def cache_salt(self) -> int | None:
        """Seeds the prefix-cache hash chain: an adapter's K/V differ from the base model's,
        and requests with another `cache_salt` (SamplingParams', or a pooling request's
        PoolingParams') must not find these."""
        adapter = None if self.lora is None else self.lora.cache_salt
        salt = self.params.cache_salt if self.pooling is None else self.pooling.cache_salt
        if salt is None:
            return adapter
        # Read for every running request every step: hashed once (the adapter is set when the
        # request is admitted, so the key only changes before it runs).
        if self._salt_seed is None or self._salt_seed[0] != (adapter, salt):
            digest = hashlib.sha256(f"{adapter}\0{salt}".encode()).digest()
            self._salt_seed = ((adapter, salt), int.from_bytes(digest[:16], "little"))
        return self._salt_seed[1]

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
