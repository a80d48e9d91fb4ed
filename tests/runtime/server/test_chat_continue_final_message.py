"""vLLM's `add_generation_prompt` and `continue_final_message` on chat (and /tokenize): an
assistant prefill that the model continues, as transformers' apply_chat_template cuts it."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve`

QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}


def _text(http: httpx.Client, **body: object) -> str:
    """The chat as rendered, read back through /tokenize and /detokenize."""
    r = http.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    r = http.post("/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_the_final_message_is_left_open(http: httpx.Client) -> None:
    opened = _text(http, messages=[QUESTION], add_generation_prompt=True)
    closed = _text(http, messages=[QUESTION, PREFILL], add_generation_prompt=False)
    continued = _text(http, messages=[QUESTION, PREFILL], add_generation_prompt=False,
                      continue_final_message=True)
    # the template closes the assistant turn after its content; continuing leaves it open
    assert closed.startswith(continued) and len(closed) > len(continued)
    assert continued == opened + PREFILL["content"]


def test_the_reply_continues_the_prefill(client: OpenAI, http: httpx.Client) -> None:
    prompt = _text(http, messages=[QUESTION, PREFILL], add_generation_prompt=False,
                   continue_final_message=True)
    chat = client.chat.completions.create(
        model=MODEL, messages=[QUESTION, PREFILL], max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    # the same prompt as a completion (its text holds the template's BOS, if any)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens


@pytest.mark.parametrize("body,message", [
    ({"messages": [QUESTION, PREFILL], "continue_final_message": True},
     "cannot both be true"),
    ({"messages": [QUESTION, {"role": "assistant", "content": ""}],
      "continue_final_message": True, "add_generation_prompt": False}, "nothing to continue"),
    ({"messages": [QUESTION], "chat_template_kwargs": {"continue_final_message": True}},
     "set by the request itself"),
])
def test_misuse_is_a_400(client: OpenAI, body: dict, message: str) -> None:
    messages = body.pop("messages")
    with pytest.raises(BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body=body)
