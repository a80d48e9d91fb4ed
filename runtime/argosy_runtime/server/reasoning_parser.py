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
"""

from __future__ import annotations

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
