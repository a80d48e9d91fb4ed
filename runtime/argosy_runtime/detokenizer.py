"""Incremental detokenization for streaming: text deltas as tokens arrive.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte UTF-8 character can be
split over several tokens, and decoders may change how a token renders depending on what
precedes it. Like vLLM, we decode a short window of recent tokens twice, with and without the
new ones (`prefix_offset` .. `read_offset` .. end), and emit only the extra text, holding it back
while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

from argosy_runtime.tokenizer import Tokenizer

# How many prompt tokens to use as left context for the first output token (vLLM uses 5).
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# A character still incomplete at the end of the text is at most 4 bytes, so it lies in the
# last 4 tokens (each at least one byte). More held tokens than this end in bytes that will
# never form a character (a model writing invalid UTF-8): the text before the last 4 is final.
_MAX_HELD_TOKENS = 8
_INCOMPLETE_CHAR_TOKENS = 4


class IncrementalDetokenizer:
    """Turn a growing list of output token ids into text deltas.

    `push(new_ids)` returns the text that became final with these ids; `text` is all output text
    so far. For byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2) the concatenated deltas
    equal `tokenizer.decode(output_ids)` once generation ends cleanly; call `flush()` at the end
    to also get a trailing incomplete character (rendered as U+FFFD, as `decode` does).
    For sentencepiece tokenizers (Llama 2, Mistral) the last prompt tokens give context, so the
    stream is the text the output adds after the prompt: a first token "▁Hello" streams as
    " Hello", where `decode(output_ids)` alone would strip that leading space (as vLLM does).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Ids decode() drops are kept out of the window (the text is the same without them):
        # the window only moves on visible text, so a long run of them was decoded again on
        # every push, quadratic in the run's length.
        self._skipped_ids = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        # All ids seen (prompt context + output) but skipped ones; offsets index into this list.
        self._ids: list[int] = self._kept(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        # A prompt ending inside a character must not lend its first bytes to the output's
        # (the stream swallowed them, the prompt's U+FFFD taking the completed character's
        # place): decode(output ids) renders the output's bytes alone, so the context ends
        # before them.
        while self._ids and self._decode(0, len(self._ids)).endswith(_REPLACEMENT_CHAR):
            self._ids.pop()
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self._ids)  # tokens before this are already emitted
        self.text = ""
        self.output_token_ids: list[int] = []

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the newly final text ("" while a character is incomplete)."""
        self.output_token_ids.extend(int(i) for i in new_token_ids)
        kept = self._kept(new_token_ids)
        if not kept:
            return ""
        self._ids.extend(kept)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a special token skipped, or a character still incomplete):
            # keep the window as is so the next push decodes these bytes together.
            if len(self._ids) - self.read_offset > _MAX_HELD_TOKENS:
                # Held this long, the window would grow with every push of invalid bytes,
                # each decoding it all again (quadratic): emit what is final.
                return self._emit_up_to(len(self._ids) - _INCOMPLETE_CHAR_TOKENS, prefix_text,
                                        new_text)
            return ""
        return self._emit(new_text[len(prefix_text):], len(self._ids))

    def _emit_up_to(self, split: int, prefix_text: str, new_text: str) -> str:
        """The text of the tokens before `split`, if cutting there splits no character: the
        tokens after it already decide how every byte before it renders."""
        final = self._decode(self.prefix_offset, split)
        if len(final) <= len(prefix_text) or not new_text.startswith(final):
            return ""
        return self._emit(final[len(prefix_text):], split)

    def _emit(self, delta: str, end: int) -> str:
        """Send `delta`, the text of the tokens up to `end`; the window moves on."""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (a trailing incomplete character becomes U+FFFD)."""
        if self.read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self._ids))
        return self._emit(new_text[len(prefix_text):], len(self._ids))

    def _kept(self, ids: Sequence[int]) -> list[int]:
        return [int(i) for i in ids if int(i) not in self._skipped_ids]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)
