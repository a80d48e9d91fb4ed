"""Per-request pooling options: how a prompt's hidden states become one output vector.

A pooling request runs its prompt through the model like a prefill and samples nothing.
`task="embed"` (the default): the hidden states after the final norm are pooled into one
vector, L2-normalized by default. `"last"` takes the last token's state, which is how
decoder-based embedding models (e5-mistral, gte-Qwen2, SFR-Embedding) are trained: with causal
attention only the last token has seen the whole input. `"mean"` averages every token's state;
`"cls"` takes the first token's (an encoder's [CLS]: bge, bge-m3). The other
sentence-transformers Pooling modes, with its formulas: `"max"` (each dimension's maximum over
the tokens), `"mean_sqrt_len_tokens"` (the sum over the n tokens divided by sqrt(n)) and
`"weightedmean"` (token i of n weighted i + 1: sum((i + 1) h_i) / sum(i + 1)). Like "mean",
these read every position (WHOLE_PROMPT_POOLINGS). None (the default) leaves
both `pooling` and `normalize` to the model (`LLMEngine.spec_pooling`): "last" for a decoder;
for an encoder (BERT, XLM-RoBERTa) its sentence-transformers pooling and Normalize module,
else "cls", normalized.
`token_type_start`: the prompt position where token type 1 begins (a BERT cross-encoder's
pair: its second text, from the tokenizer's pair encoding, `scoring.cross_encoder_prompt`);
None: every token is type 0, as transformers' `tokenizer(text)` gives a single text.
`cache_salt`: as SamplingParams' (the server sets it to the request's owner, so tenants
share no prefix-cache blocks). `dimensions` keeps the first that many values before
normalizing (Matryoshka embeddings: only for a model trained for it,
`ModelSpec.accepts_embedding_dimensions`).
`task="classify"` (a sequence-classification checkpoint only): the classification head's
logits at the last token (an encoder's: at the first, [CLS]), what transformers' `*ForSequenceClassification` returns for an
unpadded prompt; `normalize` does not apply. Every field is validated here; a bad value
raises `ValueError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from argosy_runtime.sampling_params import check_cache_salt

POOLING_TYPES = ("last", "mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean")
# Poolings that need every prompt position's hidden state: such a request takes nothing from
# the prefix cache (a cached block has no hidden states; scheduler `_prefix_lookup_limit`).
WHOLE_PROMPT_POOLINGS = ("mean", "max", "mean_sqrt_len_tokens", "weightedmean")
POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    pooling: str | None = None
    normalize: bool | None = None
    task: str = "embed"
    dimensions: int | None = None
    token_type_start: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        check_cache_salt(self.cache_salt)
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (
                not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.token_type_start is not None and (
                not isinstance(self.token_type_start, int)
                or isinstance(self.token_type_start, bool) or self.token_type_start < 0):
            raise ValueError(f"token_type_start must be a non-negative integer, "
                             f"got {self.token_type_start!r}")
        if self.task == "classify" and self.dimensions is not None:
            raise ValueError("dimensions: task 'classify' returns one logit per label; "
                             "dimensions applies to embeddings")
        if self.task == "classify" and self.pooling not in (None, "last", "cls"):
            raise ValueError("pooling: task 'classify' reads the head at the last token (an "
                             "encoder's: the first, [CLS]), as transformers' "
                             "*ForSequenceClassification; leave pooling unset")
