"""Pairing texts and scoring pairs: shared by `LLM.score` and the server's /v1/score and
/v1/rerank, so offline and online scores are the same function.

`text_1` pairs with `text_2` 1-to-1, 1-to-N (one text_1 against every text_2) or N-to-N (equal
lengths, pair by pair), vLLM's rule. A bi-encoder (embedding) model scores a pair by the
cosine similarity of the two texts' embeddings; a cross-encoder (a one-label classification
head) by its logit over the pair joined as one prompt (`cross_encoder_prompt`), through the
model's score activation (`cross_encoder_score`: the sigmoid unless its config names another).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

import torch

T = TypeVar("T")


def pair_up(firsts: Sequence[T], seconds: Sequence[T]) -> list[tuple[T, T]]:
    """The (text_1, text_2) pairs; ValueError naming `text_2` for lengths that do not pair."""
    if len(firsts) == 1:
        firsts = list(firsts) * len(seconds)
    elif len(firsts) != len(seconds):
        raise ValueError(
            f"text_2: {len(seconds)} texts do not pair with {len(firsts)} text_1: send one "
            "text_1 (scored against every text_2) or as many as text_2 (scored pair by pair)")
    return list(zip(firsts, seconds, strict=True))


def cross_encoder_score(logits: Sequence[float], activation: str) -> float:
    """A one-label head's score from its logit: `activation` is ModelSpec.score_activation
    ("sigmoid", "identity" or "tanh")."""
    if activation == "identity":
        return float(logits[0])
    logit = torch.tensor(logits[0], dtype=torch.float32)  # as ClassificationOutput.probs
    return (logit.tanh() if activation == "tanh" else logit.sigmoid()).item()


def cosine_scores(vectors: Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]]
                  ) -> list[float]:
    """The cosine similarity of each pair of rows of `vectors` (float64). Embeddings are
    unit length by default; dividing by the norms anyway keeps it a cosine whatever the
    pooling parameters were."""
    table = torch.tensor(vectors, dtype=torch.float64)  # [num_texts, hidden_size]
    left = table[[a for a, _ in pairs]]  # [num_pairs, hidden_size]
    right = table[[b for _, b in pairs]]
    return torch.nn.functional.cosine_similarity(left, right, dim=-1).tolist()


class ScorePrompt(NamedTuple):
    """A cross-encoder's prompt for one pair: its token ids, and where token type 1 starts
    (PoolingParams.token_type_start; None: all type 0)."""

    token_ids: list[int]
    token_type_start: int | None


def cross_encoder_max_length(truncate: int | None, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens` as cross_encoder_prompt's `max_length`: None or 0 keep
    the whole prompt, -1 the model's length; ValueError outside [1, max_model_len]."""
    if not truncate:
        return None
    if truncate == -1:
        return max_model_len
    if isinstance(truncate, bool) or not isinstance(truncate, int) \
            or not 0 < truncate <= max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got "
                         f"{truncate!r}")
    return truncate


def cross_encoder_prompt(tokenizer: Any, text_1: str, text_2: str, *, use_sep_token: bool = True,
                         score_template: str | None = None, max_length: int | None = None,
                         token_types: bool = False) -> ScorePrompt:
    """The prompt a cross-encoder scores for the pair, as vLLM builds it (`get_score_prompt`):
    with a score template (`--chat-template`), the template rendered over the messages
    [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}] (no
    generation prompt), then encoded; without one, the tokenizer's pair template
    (transformers' `tokenizer(text_1, text_2)`) or, for a model whose config says
    `use_sep_token: false` (an LLM reranker such as Qwen3-Reranker), `text_1 + text_2`
    encoded as one text. ValueError when the template cannot be rendered.

    `max_length` (truncate_prompt_tokens): at most that many tokens, cut from the end as
    vLLM cuts them with transformers' `tokenizer(..., truncation=True, max_length=k)`: a pair
    loses the end of its longer text first (in a query-document pair, the document's end),
    one text (the joined or rendered prompt) its end; the tokenizer's special tokens stay.
    ValueError starting "truncate_prompt_tokens" when k cannot hold those.

    `token_types` (a model that reads them, ModelSpec.takes_token_types): the pair template's
    token types, where the tokenizer puts them (BERT: the second text and its [SEP]), not
    where a [SEP] id happens to be; a text may contain the [SEP] token itself."""
    if score_template is not None or not use_sep_token:
        if score_template is not None:
            messages = [{"role": "query", "content": text_1},
                        {"role": "document", "content": text_2}]
            try:
                text = tokenizer.render_template(score_template, messages, False)  # no gen. prompt
            except ValueError as exc:
                raise ValueError(f"cannot apply the score template (--chat-template): {exc}"
                                 ) from exc
        else:
            text = text_1 + text_2
        ids = tokenizer.encode(text, max_length=max_length)
        start = None  # one text: type 0 throughout, as transformers' tokenizer(text)
    else:
        ids, types = tokenizer.encode_pair(text_1, text_2, max_length=max_length)
        start = types.index(1) if token_types and 1 in types else None
        if start is not None and any(t != 1 for t in types[start:]):
            raise ValueError(f"the tokenizer's pair template gives token types {types}; only "
                             "0s then 1s are supported")
    if max_length is not None and len(ids) > max_length:  # the tokenizer could not cut it
        raise ValueError(f"truncate_prompt_tokens ({max_length}) cannot hold the prompt's "
                         f"special tokens ({len(ids)} tokens left after truncation)")
    return ScorePrompt(ids, start)
