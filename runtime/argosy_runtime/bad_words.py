"""vLLM's `bad_words`: words a request must never generate.

A word can be several tokens, and the model can also write it with a leading space (in the
middle of a text) or without (at the start), which tokenize differently. As vLLM does
(`SamplingParams.update_from_tokenizer`), each word becomes up to two token sequences:

- the word (leading whitespace stripped) encoded on its own, without special tokens;
- " " + the word, when that encodes to as many tokens with a different first token (a BPE
  vocabulary's "Ġword" form); otherwise the space form is left out.

At every sampling step, the last token of a sequence is banned when the tokens generated just
before end with the sequence's other tokens; a one-token sequence is banned at every step.
Only generated tokens count, not the prompt, so a word whose first tokens end the prompt can
still be completed: vLLM's rule. A word the model spells with other tokens (another split,
another case) is not caught either: the ban is on these token sequences, not on text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# One bound for the words (SamplingParams checks them before tokenizing) and the token
# sequences they become here: vLLM's VLLM_MAX_NUM_BAD_WORDS default, which counts sequences.
from argosy_runtime.sampling_params import MAX_BAD_WORDS


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int
                        ) -> list[list[int]]:
    """The token sequences banned for `words` (see the module docstring). Raises ValueError
    naming `bad_words` for a word that tokenizes to nothing or to ids past the model's logits,
    or when there are more than MAX_BAD_WORDS sequences."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words[{i}] ({word!r}) tokenizes to no tokens")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
        outside = [t for seq in sequences[-2:] for t in seq if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"bad_words[{i}] ({word!r}) tokenizes to ids {outside} outside "
                             f"the model's vocabulary [0, {vocab_size})")
    if len(sequences) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words tokenize to {len(sequences)} token sequences; at most "
                         f"{MAX_BAD_WORDS}")
    return sequences


def banned_next_tokens(sequences: list[list[int]], token_ids: list[int],
                       num_prompt_tokens: int) -> list[int]:
    """The tokens that would complete a bad word now. `token_ids` is prompt + output; only
    the output (past `num_prompt_tokens`) may hold a word's first tokens."""
    num_output = len(token_ids) - num_prompt_tokens
    banned = []
    for seq in sequences:
        prefix_len = len(seq) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or token_ids[len(token_ids) - prefix_len:] == seq[:-1]:
            banned.append(seq[-1])
    return banned
