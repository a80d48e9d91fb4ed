"""Chat `content` as a list of parts, through the official `openai` client.

vLLM joins a message's text parts with a newline (chat_utils `"\\n".join(texts)`), reads an
assistant's `refusal` part as its text, and refuses media parts on a text-only model.
"""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve`


def _prompt_tokens(http: httpx.Client, messages: list[dict]) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_text_parts_are_joined_with_a_newline(client: OpenAI, http: httpx.Client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Translate to French:"},
                                          {"type": "text", "text": "Good morning"}]}]
    joined = [{"role": "user", "content": "Translate to French:\nGood morning"}]
    glued = [{"role": "user", "content": "Translate to French:Good morning"}]
    assert _prompt_tokens(http, parts) == _prompt_tokens(http, joined)
    assert _prompt_tokens(http, parts) != _prompt_tokens(http, glued)
    # the chat route renders the same prompt: same length, same greedy reply
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=6,
                                       temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(_prompt_tokens(http, joined))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_an_assistant_refusal_part_is_read_as_its_text(client: OpenAI,
                                                      http: httpx.Client) -> None:
    """The official client's types allow `{"type": "refusal"}` parts in an assistant message
    sent back with the history; OpenAI and vLLM take them."""
    def history(content: object) -> list[dict]:
        return [{"role": "user", "content": "Tell me a secret."},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "Why not?"}]

    refusal = history([{"type": "refusal", "refusal": "I cannot share that."}])
    text = history("I cannot share that.")
    assert _prompt_tokens(http, refusal) == _prompt_tokens(http, text)
    r = client.chat.completions.create(model=MODEL, messages=refusal, max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_media_parts_are_refused_naming_the_part(client: OpenAI, part: dict) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    body = err.value.body
    assert err.value.status_code == 400
    assert body["type"] == "invalid_request_error" and body["param"] == "messages"
    # says which part and why, not that the content should have been a string
    assert body["message"].startswith("messages.0.content: part 1 has type"), body
    assert repr(part["type"]) in body["message"], body
    assert "text" in body["message"] and "valid string" not in body["message"], body


def test_a_text_part_without_text_is_still_a_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
