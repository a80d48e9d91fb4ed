"""vLLM's `use_beam_search` on a real server through the official `openai` client: the choices
are the offline `LLM.beam_search` hypotheses, best first, on /v1/completions and
/v1/chat/completions, streamed or not; options a beam search cannot honour are 400s naming
them."""

from __future__ import annotations

import httpx
import pytest
from argosy_runtime import BeamSearchParams
from openai import OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

STORY = "Once upon a time, there was a"
MESSAGES = [{"role": "user", "content": "Name a color."}]


def test_completions_equal_the_offline_beam_search(client: OpenAI, offline_llm) -> None:
    body = {"use_beam_search": True, "length_penalty": 0.5}
    r = client.completions.create(model=MODEL, prompt=[STORY, "The capital of France is"],
                                  n=3, max_tokens=8, temperature=0.7, extra_body=body)
    want = offline_llm.beam_search([STORY, "The capital of France is"],
                                   BeamSearchParams(beam_width=3, max_tokens=8,
                                                    length_penalty=0.5))
    expected = [seq for out in want for seq in out.sequences]
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.text for s in expected]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in expected]
    assert len({c.text for c in r.choices[:3]}) == 3  # three different hypotheses
    prompt_tokens = sum(len(offline_llm.engine.tokenizer.encode(p))
                        for p in (STORY, "The capital of France is"))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == sum(len(s.tokens) for s in expected) - 3 * prompt_tokens

    echoed = client.completions.create(model=MODEL, prompt=STORY, n=3, max_tokens=8, echo=True,
                                       extra_body=body)
    assert [c.text for c in echoed.choices] == [STORY + s.text for s in want[0].sequences]
    streamed = client.completions.create(model=MODEL, prompt=STORY, n=3, max_tokens=8,
                                         stream=True, extra_body=body)
    assert sorted((c.choices[0].index, c.choices[0].text) for c in streamed) == [
        (i, s.text) for i, s in enumerate(want[0].sequences)]


def test_chat_streamed_and_not_equal_the_offline_beam_search(client: OpenAI,
                                                             offline_llm) -> None:
    tok = offline_llm.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True),
                        add_special_tokens=False)
    [want] = offline_llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=12))
    kwargs = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=12,
                  extra_body={"use_beam_search": True})
    r = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in r.choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want.sequences]
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {c.choices[0].index: c.choices[0].delta.content for c in chunks if c.choices}
    assert [texts[i] for i in range(2)] == [s.text for s in want.sequences]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ["."]}, "stop"),
    ({"top_p": 0.5}, "top_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ({"n": 11}, "n"),  # a width whose candidates outgrow the top log-probabilities
    # 0 asks for log-probabilities too (the chosen token's, each prompt token's): they were
    # dropped silently, since `0 in (None, False)` holds in Python
    ({"logprobs": 0}, "logprobs"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
])
def test_options_a_beam_search_cannot_honour_are_400s(http: httpx.Client, extra: dict,
                                                      param: str) -> None:
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 4, "use_beam_search": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "use_beam_search": True,
            **({"logprobs": True} if param == "logprobs" else extra)}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
