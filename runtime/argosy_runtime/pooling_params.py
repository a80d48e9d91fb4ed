"""Per-request embedding options: how a prompt's hidden states become one vector.

An embedding request runs its prompt through the model like a prefill and samples nothing:
the hidden states after the final norm are pooled into one vector, L2-normalized by default.
`"last"` takes the last token's state, which is how decoder-based embedding models
(e5-mistral, gte-Qwen2, SFR-Embedding) are trained: with causal attention only the last token
has seen the whole input. `"mean"` averages every token's state. Every field is validated
here; a bad value raises `ValueError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
