"""Pairing texts and scoring pairs: shared by `LLM.score` and the server's /v1/score and
/v1/rerank, so offline and online scores are the same function.

`text_1` pairs with `text_2` 1-to-1, 1-to-N (one text_1 against every text_2) or N-to-N (equal
lengths, pair by pair), vLLM's rule. A bi-encoder (embedding) model scores a pair by the
cosine similarity of the two texts' embeddings; a cross-encoder (a one-label classification
head) by the sigmoid of its logit over the pair joined as one prompt (`cross_encoder_prompt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

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


def cosine_scores(vectors: Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]]
                  ) -> list[float]:
    """The cosine similarity of each pair of rows of `vectors` (float64). Embeddings are
    unit length by default; dividing by the norms anyway keeps it a cosine whatever the
    pooling parameters were."""
    table = torch.tensor(vectors, dtype=torch.float64)  # [num_texts, hidden_size]
    left = table[[a for a, _ in pairs]]  # [num_pairs, hidden_size]
    right = table[[b for _, b in pairs]]
    return torch.nn.functional.cosine_similarity(left, right, dim=-1).tolist()


def cross_encoder_prompt(tokenizer: Any, text_1: str, text_2: str, *, use_sep_token: bool = True,
                         score_template: str | None = None,
                         max_length: int | None = None) -> list[int]:
    """The token ids a cross-encoder scores for the pair, as vLLM builds them: with a score
    template (`--chat-template`), the template rendered over the messages
    [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}] (no
    generation prompt), then encoded; without one, the tokenizer's pair template
    (transformers' `tokenizer(text_1, text_2)`) or, for a model whose config says
    `use_sep_token: false` (an LLM reranker such as Qwen3-Reranker), `text_1 + text_2`
    encoded as one text. ValueError when the template cannot be rendered. `max_length`
    (the tokenizer's pair template only): truncated as transformers' tokenizer(text_1, text_2,
    truncation=True, max_length=k) truncates (Tokenizer.encode_pair)."""
    if score_template is not None:
        import jinja2

        messages = [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]
        try:
            text = tokenizer.render_template(score_template, messages, False)  # no generation prompt
        except jinja2.TemplateError as exc:
            raise ValueError(f"cannot apply the score template (--chat-template): {exc}") from exc
        return tokenizer.encode(text)
    if not use_sep_token:
        return tokenizer.encode(text_1 + text_2)
    return tokenizer.encode_pair(text_1, text_2, max_length=max_length)
