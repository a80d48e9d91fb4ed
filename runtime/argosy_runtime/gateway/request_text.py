"""The text of an OpenAI request as the gateway reads it (it has no tokenizer).

Routing hashes the leading part of this text; the cascade measures and searches it.
"""

from __future__ import annotations

import json
from typing import Any

# Separators that cannot be confused with message text, so "ab"+"c" != "a"+"bc" across turns.
_ROLE_SEP = "\x1f"
_TURN_SEP = "\x1e"
# content part type -> the key holding its text: chat's parts, and the Responses API's
# (input, and earlier output passed back), a refusal read as its text, as the replica reads it
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal"}
# The runtime's scoring and classification routes (vLLM's paths, Cohere's /v2/rerank), and
# every route answered from one model's pooled hidden states: routed like /v1/embeddings,
# never through a cascade.
SCORE_PATHS = ("/v1/score", "/score")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
CLASSIFY_PATHS = ("/v1/classify", "/classify")
POOLING_PATHS = ("/v1/embeddings", *SCORE_PATHS, *RERANK_PATHS, *CLASSIFY_PATHS)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # The text parts joined with newlines, as the replica joins them (serving_chat.py,
        # responses/input_items.py): parts and the string they make are one cached prompt.
        return "\n".join(
            str(p.get(_TEXT_PARTS[p["type"]], ""))
            for p in content
            # str first: a list `type` is unhashable, and a malformed part must not fail
            # routing (the replica answers it with its own 400)
            if isinstance(p, dict) and isinstance(p.get("type"), str) and p["type"] in _TEXT_PARTS
        )
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt of a completion, the `input` of an embeddings or classify request, the
    `text_1` of a score request, the `query` of a rerank request, or the chat history flattened turn by
    turn.

    A token-id prompt becomes its ids as text (equal id prefixes give equal text prefixes).
    For a batch of prompts (or of embeddings inputs), the first one speaks for the batch.

    A Responses API request reads as the chat conversation it becomes (`instructions` a system
    turn, a string `input` a user turn), so both APIs route the same conversation alike.
    """
    messages = _chat_messages(path, body)
    if messages is not None:
        return _turns(messages)
    if path.endswith("/embeddings") or path in CLASSIFY_PATHS:
        # `input` has the shapes of a completion's `prompt`: a string, strings, token ids,
        # lists of token ids. An embedding's prefill fills the replica's prefix cache as a
        # prompt's does, so it is routed by the same text.
        return _first_prompt(body.get("input"))
    # The query (a score request's first text_1): each text is embedded on its own, and a
    # query asked again (against other documents) finds its prefill in the same replica's
    # prefix cache.
    if path in SCORE_PATHS:
        return _first_prompt(body.get("text_1"))
    if path in RERANK_PATHS:
        return _first_prompt(body.get("query"))
    return _first_prompt(body.get("prompt"))


def routing_text(path: str, body: dict[str, Any]) -> str:
    """`prompt_text` with a chat or Responses request's function `tools`, where chat templates
    render them: after the leading system turns (inside the system prompt for Qwen, Hermes and
    SmolLM3; the first user turn for Llama 3.1). Agents that send one long tool list with
    different conversations share that prefix in the replica's cache, and a changed tool list
    changes it: routing that ignored the tools placed neither by what the replica had cached.

    Only routing reads it: the cascade judges what the client wrote, not the tool schemas."""
    messages = _chat_messages(path, body)
    tools = body.get("tools")
    if messages is None or not isinstance(tools, list) or not tools:
        return prompt_text(path, body)
    lead = 0
    while (lead < len(messages) and isinstance(messages[lead], dict)
           and _role(messages[lead].get("role")) == "system"):
        lead += 1
    # Responses' flat function tools as the chat tools the replica makes of them
    # (responses/tools.py), so both APIs place the same request alike.
    as_chat = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               if isinstance(t, dict) and t.get("type") == "function" and "function" not in t
               else t for t in tools]
    schemas = json.dumps(as_chat, sort_keys=True, separators=(",", ":"), default=str)
    return f"{_turns(messages[:lead])}tools{_ROLE_SEP}{schemas}{_TURN_SEP}{_turns(messages[lead:])}"


def content_text(path: str, body: dict[str, Any]) -> str:
    """What the client wrote: `prompt_text` without the chat roles (the cascade searches its
    keywords in it). Turns stay separated, so a keyword never spans two of them."""
    messages = _chat_messages(path, body)
    if messages is None:
        return _TURN_SEP.join(prompt_texts(path, body))
    return _TURN_SEP.join(_content_text(m.get("content")) for m in messages
                          if isinstance(m, dict))


def prompt_texts(path: str, body: dict[str, Any]) -> list[str]:
    """Every prompt of a completions batch, each as `prompt_text` reads one; `[prompt_text]`
    for any other request. The cascade judges each: the model it picks answers them all, so a
    long prompt (or one with a keyword) must not hide behind a short first one."""
    prompt = body.get("prompt")
    completions = path.endswith("/completions") and not path.endswith("/chat/completions")
    if completions and isinstance(prompt, list) and prompt \
            and not all(isinstance(t, int) for t in prompt):
        return [_first_prompt([item]) for item in prompt]
    return [prompt_text(path, body)]


def _chat_messages(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The conversation of a chat or Responses request ([] when its messages are not a
    list); None for the other routes."""
    if path.endswith("/responses"):
        return _responses_messages(body)
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return messages if isinstance(messages, list) else []
    return None


def _first_prompt(prompt: Any) -> str:
    """A completion prompt (or embeddings input) as text: the first of a batch."""
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))
        prompt = prompt[0]
        if isinstance(prompt, list):
            return " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def prompt_chars(path: str, body: dict[str, Any]) -> int:
    """How many characters of prompt a request sends, for the token estimate of an answer
    that reports no usage (tenants/usage.py). Every input of an embeddings (or classify)
    batch counts: a
    batch is often hundreds of inputs, and its answer (a vector per input) is the one most
    likely too large for the meter to read its `usage` from, so its first input alone would
    undercharge it. So does every prompt of a completions batch (each one generates). Score
    and rerank requests: every text they send, each one embedded. Other requests: the length
    of `prompt_text`."""
    if path in SCORE_PATHS or path in RERANK_PATHS:
        fields = ("text_1", "text_2") if path in SCORE_PATHS else ("query", "documents")
        return sum(_all_chars(body.get(f)) for f in fields)
    completions = path.endswith("/completions") and not path.endswith("/chat/completions")
    batched = completions or path.endswith("/embeddings") or path in CLASSIFY_PATHS
    inputs = body.get("prompt" if completions else "input")
    is_batch = isinstance(inputs, list) and not all(isinstance(t, int) for t in inputs)
    if batched and is_batch:
        return sum(len(_first_prompt([item])) for item in inputs)
    return len(prompt_text(path, body))


def _all_chars(texts: Any) -> int:
    """The characters of a string, or of every string in a list."""
    if isinstance(texts, str):
        return len(texts)
    if isinstance(texts, list):
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0


def _turns(messages: list[Any]) -> str:
    return "".join(
        f"{_role(m.get('role', ''))}{_ROLE_SEP}{_content_text(m.get('content'))}{_TURN_SEP}"
        for m in messages
        if isinstance(m, dict)
    )


def _role(role: Any) -> Any:
    """The replica renders a developer turn as a system turn (serving_chat.py)."""
    return "system" if role == "developer" else role


def _responses_messages(body: dict[str, Any]) -> list[Any]:
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        # The chat messages the replica makes of the items (responses/input_items.py), so a
        # conversation reads as in chat: a function call is an assistant turn's tool call
        # (consecutive ones, and ones right after an assistant message, share its turn), its
        # output a tool turn, and earlier reasoning is not shown to the model.
        for item in items:
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message":
                messages.append(item)
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": item.get("output")})
            elif kind == "function_call" and not (
                    messages and messages[-1].get("role") == "assistant"):
                messages.append({"role": "assistant", "content": None})
    return messages


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens` (newer chat field), `max_tokens`, or the Responses API's
    `max_output_tokens`, when an integer."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
