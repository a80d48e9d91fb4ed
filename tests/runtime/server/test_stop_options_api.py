"""vLLM's `include_stop_str_in_output` on completions and chat, streamed and not."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve`

PROMPT = "Count: 1, 2, 3, 4,"


def _streamed(chunks) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunks:
        for choice in c.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client: OpenAI, stream: bool) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text
    stop = " " + base.split()[2]  # a stop string the greedy reply reaches after two words
    at = base.index(stop)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    if stream:
        plain = _streamed(client.completions.create(**kw, stream=True))
        kept = _streamed(client.completions.create(
            **kw, stream=True, extra_body={"include_stop_str_in_output": True}))
    else:
        r = client.completions.create(**kw)
        plain = (r.choices[0].text, r.choices[0].finish_reason)
        r = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
        kept = (r.choices[0].text, r.choices[0].finish_reason)
    assert plain == (base[:at], "stop")
    assert kept == (base[:at + len(stop)], "stop")


def test_include_stop_str_in_output_on_chat(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10."}]
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                          temperature=0).choices[0].message.content
    stop = base.split()[1]
    at = base.index(stop)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                       temperature=0, stop=stop,
                                       extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == base[:at + len(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_must_be_a_boolean(client: OpenAI) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"include_stop_str_in_output": "yes"})
    assert err.value.body["param"] == "include_stop_str_in_output"
