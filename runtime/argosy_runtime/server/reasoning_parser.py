"""Reasoning models' thinking apart from their answer (`--reasoning-parser`, as vLLM's).

Qwen3, QwQ and DeepSeek-R1 write their chain of thought between `<think>` and `</think>`
before the answer. With a parser, chat replies carry it in the message's (or stream delta's)
`reasoning_content`, DeepSeek's API field that chat UIs and LangChain read, and `content`
holds only the answer; tool-call parsing (`--tool-call-parser`) then reads the answer alone.

- `qwen3`: the model writes `<think>` itself (Qwen3, QwQ). A reply that does not start with it
  is all answer (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`, whose template
  puts the empty think block in the prompt).
- `deepseek_r1`: the template opens `<think>` in the prompt (DeepSeek-R1 and its distills,
  Qwen3's *-Thinking-2507 models), so the reply starts inside the thinking: everything up to
  `</think>` is reasoning, all of it if the reply ends before (max_tokens), as with `qwen3`
  after an opening `<think>`.

The reasoning has surrounding blank lines stripped, the answer its leading ones. Streaming
sends each part as it grows and holds back only what could still be the start of a tag, so
the streamed parts add up to the non-streamed ones.

`count_reasoning_tokens` is usage's `reasoning_tokens` (OpenAI's
`completion_tokens_details.reasoning_tokens`, Responses' `output_tokens_details`): the
generated tokens that carry the thinking, between the tags and without them, as vLLM's think
parsers count them, so a reply cut off while thinking counts every token after `<think>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from argosy_runtime.detokenizer import IncrementalDetokenizer

START, END = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole reply; reasoning None when the reply has none."""
    body = text.lstrip()
    opened = body.startswith(START)
    if not opened and parser == "qwen3":
        return None, text
    if opened:
        body = body[len(START):]
    if END not in body:
        return body.strip(), ""
    reasoning, answer = body.split(END, 1)
    return reasoning.strip(), answer.lstrip()


def reasoning_span(parser: str, text: str) -> tuple[int, int] | None:
    """The characters [start, end) of a whole reply between its tags (split_reasoning's
    reasoning before stripping), None when the reply has no reasoning."""
    body = text.lstrip()
    opened = body.startswith(START)
    if not opened and parser == "qwen3":
        return None
    start = len(text) - len(body) + len(START) if opened else 0
    end = text.find(END, start)
    return start, len(text) if end < 0 else end


def count_reasoning_tokens(parser: str, text: str, token_ends: Sequence[int]) -> int:
    """How many tokens of a reply carry its reasoning; `token_ends[i]`: the length of the
    reply's text once token i is decoded (`token_ends`). A token counts when its text
    overlaps the reasoning (one straddling a tag, such as " see</", carries some of it);
    tokens of no text yet (the first bytes of a character) go with the one completing it."""
    span = reasoning_span(parser, text)
    if span is None:
        return 0
    start, end = span
    count, begin, group = 0, 0, 0
    for stop in token_ends:
        group += 1
        if stop == begin:
            continue  # no text yet: decided with the token that completes it
        if max(begin, start) < min(stop, end):
            count += group
        begin, group = stop, 0
    return count


def token_ends(tokenizer: Any, prompt_ids: Sequence[int], token_ids: Sequence[int],
               skip_special_tokens: bool) -> list[int]:
    """For each generated token, the length of the reply's text once it is decoded: the
    engine's own detokenization replayed (one token at a time, the prompt's last tokens as
    context), so the offsets are those of the text the parser split. Cheap next to
    generating: ~30 ms for 6,000 tokens on a shared CPU core."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    ends = []
    for token in token_ids:
        detokenizer.push([token])
        ends.append(len(detokenizer.text))
    return ends


class ReasoningStream:
    """One choice's text in, (reasoning delta, answer delta) out: what split_reasoning gives
    the whole reply, in parts. Each delta looks at the new text only (and what is held back
    with it), never the reply so far: a thought runs to tens of thousands of tokens, and the
    event loop that does this serves every stream."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.phase = "start"  # then "reasoning", "answer", or "raw" (qwen3, no `<think>`)
        self.held = ""  # received, not yet sent: what a tag may still take, or blanks
        self.started = False  # the phase's first visible character is out (blanks before: none)

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        reasoning = ""
        if self.phase == "start":
            head = self.held.lstrip()
            if START.startswith(head) and not finished:
                return "", ""  # may still become the opening tag that decides
            if head.startswith(START):
                self.phase, self.held = "reasoning", head[len(START):]
            else:  # qwen3: no reasoning at all; deepseek_r1: the prompt opened it
                self.phase = "raw" if self.parser == "qwen3" else "reasoning"
        if self.phase == "reasoning":
            end = self.held.find(END)
            if end < 0:
                keep = 0 if finished else _partial_tag_length(self.held, END)
                reasoning = self._visible(len(self.held) - keep, finished)
                return reasoning, ""
            reasoning = self._visible(end, True)  # held now starts with the tag
            self.phase, self.held, self.started = "answer", self.held[len(END):], False
        if self.phase == "answer" and not self.started:  # the answer's leading blanks go
            self.held = self.held.lstrip()
            self.started = bool(self.held)
        answer, self.held = self.held, ""
        return reasoning, answer

    def _visible(self, upto: int, last: bool) -> str:
        """The reasoning in held[:upto], which leaves held: without leading blanks, and
        trailing ones kept back until more reasoning follows (dropped if `last`)."""
        part, self.held = self.held[:upto], self.held[upto:]
        if not self.started:
            part = part.lstrip()
            self.started = bool(part)
        body = part.rstrip()
        if not last:
            self.held = part[len(body):] + self.held
        return body


def _partial_tag_length(text: str, tag: str) -> int:
    """The longest end of `text` that is a beginning of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
