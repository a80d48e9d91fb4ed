"""`SpeculativeConfig`: what `speculative=` on LLM/LLMEngine and `--speculative` accept."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft" (a smaller model)
    num_speculative_tokens: int = 4
    # n-gram prompt lookup: match the last n tokens, longest n first.
    ngram_min: int = 1
    ngram_max: int = 4
    # draft: a model path with the same tokenizer, or None for a self-draft made of the
    # target's first `draft_layers` layers plus its final norm and head.
    model: str | None = None
    draft_layers: int | None = None
    # draft: "int4" or "int8" makes the draft a quantized copy of `model` (of the target itself
    # when `model` is unset), with its own KV cache.
    quantization: str | None = None
    # Adaptive k: a request whose recent acceptance rate falls below this stops speculating
    # for a while (doubling back-off), so free generation pays almost nothing.
    min_acceptance_rate: float = 0.3
    adaptive: bool = True
    # Speculate only while at most this many requests run (None: always). A verification
    # pass costs k + 1 query rows per request: cheap while the step is bound by reading the
    # weights, not once the batch makes it compute-bound. On 2 CPU cores an int4 draft gave
    # 1.7x at batch 1, ~1.0x at 4 and 0.6x at 16 (docs/benchmarks/speculative.md).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.quantization not in (None, "int4", "int8"):
            raise ValueError(f"speculative quantization must be 'int4', 'int8' or unset, "
                             f"got {self.quantization!r}")
        if self.method == "ngram" and (self.model is not None or self.draft_layers is not None
                                       or self.quantization is not None):
            raise ValueError("speculative model/draft_layers/quantization need method 'draft'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or unset, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")

    @property
    def has_own_cache(self) -> bool:
        """A separate draft model (`model`, or a quantized copy of the target), with a KV
        cache and blocks of its own (draft_cache.py); a self-draft shares the target's."""
        return self.method == "draft" and (self.model is not None or self.quantization is not None)

    def _check_types(self) -> None:
        """ValueError for a field of the wrong JSON type: the range checks below raised a
        TypeError on a string ('<=' between int and str) and let a float count through."""
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max", "draft_layers",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            optional = name in ("draft_layers", "disable_by_batch_size")
            if (value is None and optional) or (isinstance(value, int)
                                                and not isinstance(value, bool)):
                continue
            raise ValueError(f"{name} must be an integer{' or unset' if optional else ''}, "
                             f"got {value!r}")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise ValueError(f"min_acceptance_rate must be a number in [0, 1], got {rate!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.model is not None and not (isinstance(self.model, str) and self.model.strip()):
            # "" is no model: it passed as one for "draft", and as none for "ngram"
            raise ValueError(f"model must be a path or unset, got {self.model!r}")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """'ngram', 'draft', a JSON object string, or a dict of the fields above."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("{") else {"method": text}
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a method name or a dict, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative option(s): {', '.join(unknown)}")
        return cls(**value)
