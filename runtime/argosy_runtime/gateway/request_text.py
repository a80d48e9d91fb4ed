"""The text of an OpenAI request as the gateway reads it (it has no tokenizer).

Routing hashes the leading part of this text; the cascade measures and searches it.
"""

from __future__ import annotations

from typing import Any

# Separators that cannot be confused with message text, so "ab"+"c" != "a"+"bc" across turns.
_ROLE_SEP = "\x1f"
_TURN_SEP = "\x1e"
# chat's text parts, and the Responses API's (input, and earlier output passed back)
_TEXT_PARTS = ("text", "input_text", "output_text")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
        )
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt of a completion, or the chat history flattened turn by turn.

    A token-id prompt becomes its ids as text (equal id prefixes give equal text prefixes).
    For a batch of prompts, the first one speaks for the batch.

    A Responses API request reads as the chat conversation it becomes (`instructions` a system
    turn, a string `input` a user turn), so both APIs route the same conversation alike.
    """
    if path.endswith("/responses"):
        return _turns(_responses_messages(body))
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return _turns(messages) if isinstance(messages, list) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))
        prompt = prompt[0]
        if isinstance(prompt, list):
            return " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def _turns(messages: list[Any]) -> str:
    return "".join(
        f"{m.get('role', '')}{_ROLE_SEP}{_content_text(m.get('content'))}{_TURN_SEP}"
        for m in messages
        if isinstance(m, dict)
    )


def _responses_messages(body: dict[str, Any]) -> list[Any]:
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(items)
    return messages


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens` (newer chat field), `max_tokens`, or the Responses API's
    `max_output_tokens`, when an integer."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
