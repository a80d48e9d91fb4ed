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
    """One choice's text in, (reasoning delta, answer delta) out."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0  # characters of split_reasoning's parts already sent
        self.sent_answer = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.text += text
        visible = self.text if finished else self.text[: len(self.text) - self._held()]
        reasoning, answer = split_reasoning(self.parser, visible)
        if not finished and reasoning is not None and not answer:
            reasoning = reasoning.rstrip()  # blank lines before a `</think>` still to come
        r_delta = (reasoning or "")[self.sent_reasoning:]
        a_delta = answer[self.sent_answer:]
        self.sent_reasoning += len(r_delta)
        self.sent_answer += len(a_delta)
        return r_delta, a_delta

    def _held(self) -> int:
        """How many trailing characters could still turn into a tag (or, before anything
        else, into the opening `<think>` that decides whether there is reasoning at all)."""
        head = self.text.lstrip()
        if START.startswith(head):
            return len(self.text)
        if END in self.text or (self.parser == "qwen3" and not head.startswith(START)):
            return 0  # past the thinking, or (qwen3, no opening tag) there is none
        for n in range(min(len(END) - 1, len(self.text)), 0, -1):
            if END.startswith(self.text[-n:]):
                return n
        return 0
