"""A causal LM read as a sequence classifier whose head is rows of its lm_head: vLLM's online
conversion for decoder "LLM as reranker" models, which score a prompt by the logits of
answer tokens (Qwen3-Reranker: "no" / "yes"; mxbai-rerank-v2: "0" / "1").

Asked for with config fields, usually through `--hf-overrides` on the causal-LM checkpoint:

    {"architectures": ["Qwen3ForSequenceClassification"],
     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}

- `method: "from_2_way_softmax"` with two tokens [false, true]: one label whose weight row is
  lm_head[true] - lm_head[false] (in float32), so sigmoid(logit) = softmax over the two
  tokens' logits = P(true): the score the original model gives.
- `method: "no_post_processing"`: one label per token, its lm_head row as is (one token, such
  as bge-reranker-v2-gemma's ["Yes"]: the score is the sigmoid of that token's logit).
- `is_original_qwen3_reranker: true` (Qwen3ForSequenceClassification only) means
  `from_2_way_softmax`, as in vLLM.

The tokens are vocabulary entries (transformers' `convert_tokens_to_ids`, not encoded text),
resolved against the checkpoint's tokenizer at load (`resolve_token_ids`). The head is read
from `lm_head.weight`, or from `model.embed_tokens.weight` when the checkpoint ties them
(Qwen3-Reranker-0.6B). Such a reranker joins a pair without a separator (vLLM's
`use_sep_token` defaults to false for it): text_1 + text_2, unless a score template is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from argosy_runtime.model_loader.model_spec import (
    CLASSIFIER_HF_ARCHITECTURES,
    HEADLESS_HF_ARCHITECTURES,
    HF_ARCHITECTURES,
    ModelSpec,
)

FROM_2_WAY_SOFTMAX = "from_2_way_softmax"
NO_POST_PROCESSING = "no_post_processing"
METHODS = (FROM_2_WAY_SOFTMAX, NO_POST_PROCESSING)
LM_HEAD = "lm_head.weight"
EMBED_TOKENS = "model.embed_tokens.weight"
SCORE = "score.weight"


def convert_spec(spec: ModelSpec, config: dict[str, Any],
                 file_config: dict[str, Any] | None = None) -> ModelSpec:
    """`spec` as an lm_head-derived classifier when `config` (config.json with the overrides
    applied) asks for one, else `spec` itself (with config's `use_sep_token`). `file_config`
    is config.json as stored, to name what the checkpoint really is in errors.

    Raises ValueError, naming the field, for a request that cannot be met: tokens without a
    method, an unknown method, a token count the method does not take, a non-classifier
    architecture, or a checkpoint without a language-model head."""
    tokens = config.get("classifier_from_token")
    method = config.get("method")
    arch = _hf_architecture_name(config)
    if config.get("is_original_qwen3_reranker"):
        if arch != "Qwen3ForSequenceClassification":
            raise ValueError(
                "is_original_qwen3_reranker applies to architectures "
                "[\"Qwen3ForSequenceClassification\"] (Qwen3-Reranker); for another model "
                f"({arch}) set method: \"{FROM_2_WAY_SOFTMAX}\" instead")
        if not isinstance(tokens, list) or len(tokens) != 2:
            raise ValueError(
                "is_original_qwen3_reranker needs classifier_from_token with two tokens, the "
                f"'no' then the 'yes' answer: [\"no\", \"yes\"], got {tokens!r}")
        method = FROM_2_WAY_SOFTMAX
    if tokens is None:
        if method is not None and arch in CLASSIFIER_HF_ARCHITECTURES:
            raise ValueError(f"method {method!r} needs classifier_from_token: the tokens whose "
                             "lm_head rows make the classification head")
        return _with_sep_token(spec, config, default=True)
    if arch not in CLASSIFIER_HF_ARCHITECTURES:
        raise ValueError(
            "classifier_from_token turns a causal LM's lm_head into a classification head: "
            "set architectures to a sequence-classification class as well, e.g. "
            "[\"Qwen3ForSequenceClassification\"] for a Qwen3 checkpoint (supported: "
            f"{', '.join(sorted(CLASSIFIER_HF_ARCHITECTURES))}); got {arch!r}")
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"classifier_from_token must be a non-empty list of token strings, "
                         f"got {tokens!r}")
    if method is None:
        raise ValueError(
            f"classifier_from_token needs method: \"{FROM_2_WAY_SOFTMAX}\" (two tokens, "
            f"[false, true]: score = P(true)) or \"{NO_POST_PROCESSING}\" (each token's "
            "logit), or is_original_qwen3_reranker: true for Qwen3-Reranker")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == FROM_2_WAY_SOFTMAX and len(tokens) != 2:
        raise ValueError(f"method {FROM_2_WAY_SOFTMAX} needs two classifier_from_token "
                         f"entries, [false, true], got {len(tokens)}: {tokens!r}")
    stored = _hf_architecture_name(file_config) if file_config is not None else None
    if stored in HEADLESS_HF_ARCHITECTURES:
        raise ValueError(f"classifier_from_token reads rows of the lm_head, but this checkpoint "
                         f"is a headless {stored} (no language-model head)")
    if stored in CLASSIFIER_HF_ARCHITECTURES:
        raise ValueError(f"classifier_from_token builds a classification head from the lm_head, "
                         f"but this checkpoint is already a {stored} (it has its own head): "
                         "drop classifier_from_token / method / is_original_qwen3_reranker")
    num_labels = 1 if method == FROM_2_WAY_SOFTMAX else len(tokens)
    spec = dataclasses.replace(
        spec, id2label=tuple(f"LABEL_{i}" for i in range(num_labels)),
        classifier_from_token=tuple(tokens), classifier_method=method,
        classifier_from_tied_embeddings=bool(config.get("tie_word_embeddings", False)))
    return _with_sep_token(spec, config, default=False)


def resolve_token_ids(spec: ModelSpec, tokenizer: Any) -> ModelSpec:
    """`spec` with `classifier_token_ids`: each of `classifier_from_token` looked up in the
    vocabulary (transformers' `convert_tokens_to_ids`). ValueError for a token that is not
    one vocabulary entry, or one beyond the model's vocab_size."""
    if not spec.classifier_from_token:
        return spec
    ids = []
    for token in spec.classifier_from_token:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            spelled = tokenizer.convert_ids_to_tokens(encoded)
            hint = (f"; it encodes to the token {spelled[0]!r}: name that spelling"
                    if len(encoded) == 1 else
                    f"; it encodes to {len(encoded)} tokens {spelled!r}" if encoded else "")
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's "
                             f"vocabulary (each entry must be one vocabulary token){hint}")
        if token_id >= spec.vocab_size:
            raise ValueError(f"classifier_from_token: {token!r} is token {token_id}, beyond the "
                             f"lm_head's {spec.vocab_size} rows")
        ids.append(token_id)
    return dataclasses.replace(spec, classifier_token_ids=tuple(ids))


def source_weight(spec: ModelSpec) -> str:
    """The checkpoint tensor the head's rows come from (lm_head, or the tied embedding)."""
    return EMBED_TOKENS if spec.classifier_from_tied_embeddings else LM_HEAD


def head_from_rows(spec: ModelSpec, table: torch.Tensor) -> torch.Tensor:
    """The classification head [num_labels, hidden] (float32) from lm_head rows `table`
    [vocab, hidden]: lm_head[true] - lm_head[false] (from_2_way_softmax) or the tokens' rows."""
    rows = table[list(spec.classifier_token_ids)].float()  # [num_tokens, hidden]
    if spec.classifier_method == FROM_2_WAY_SOFTMAX:
        return rows[1:2] - rows[0:1]
    return rows


def convert_weights(weights: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with the lm_head replaced by the classification head `score.weight` (a tied
    embedding is yielded as the embedding and read for the head as well)."""
    source = source_weight(spec)
    for name, tensor in weights:
        if name == source:
            yield SCORE, head_from_rows(spec, tensor)
            if name == LM_HEAD:
                continue
        yield name, tensor


def _with_sep_token(spec: ModelSpec, config: dict[str, Any], default: bool) -> ModelSpec:
    """vLLM's `use_sep_token`: a cross-encoder joins a pair with the tokenizer's pair template
    (true, the default) or as the plain text_1 + text_2 (false; an LLM reranker's default)."""
    value = config.get("use_sep_token", default)
    if not isinstance(value, bool):
        raise ValueError(f"use_sep_token must be true or false, got {value!r}")
    return spec if value == spec.use_sep_token else dataclasses.replace(spec, use_sep_token=value)


def _hf_architecture_name(config: dict[str, Any]) -> str | None:
    """The first of config's `architectures` we know (else the first listed, or None)."""
    names = config.get("architectures") or []
    return next((n for n in names if n in HF_ARCHITECTURES), names[0] if names else None)
