"""vLLM's `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens` on /v1/completions and
/v1/chat/completions, sent through the official `openai` client's `extra_body` to a real
server: the same tokens as the offline engine with the same SamplingParams, and 400s naming
the field for bad values."""

from __future__ import annotations

import httpx
import pytest
from argosy_runtime import SamplingParams
from openai import OpenAI
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

STORY = "Once upon a time, there was a"
SMALL, TOWN, COMMA, A, DOT = 1165, 3102, 28, 253, 30  # " small", " town", ",", " a", "."
ALLOWED = [SMALL, TOWN, COMMA, A, DOT]
MESSAGES = [{"role": "user", "content": "Where do people live? Answer in one sentence."}]


def offline(llm, prompt, **kwargs):  # noqa: ANN001, ANN201
    return llm.generate([prompt], SamplingParams(**kwargs))[0].outputs[0]


def test_allowed_token_ids_greedy_equals_the_offline_engine(client: OpenAI, offline_llm) -> None:
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=10,
                                  extra_body={"allowed_token_ids": ALLOWED, "ignore_eos": True})
    want = offline(offline_llm, STORY, temperature=0, max_tokens=10, ignore_eos=True,
                   allowed_token_ids=ALLOWED)
    assert r.choices[0].text == want.text and set(want.token_ids) <= set(ALLOWED)
    assert r.usage.completion_tokens == 10


def test_allowed_token_ids_sampled_n_with_logprobs(client: OpenAI, offline_llm) -> None:
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=1.5, seed=3, n=3,
                                  max_tokens=8, logprobs=2,
                                  extra_body={"allowed_token_ids": ALLOWED, "ignore_eos": True})
    pieces = {offline_llm.engine.tokenizer.decode([t]) for t in ALLOWED}
    assert len({c.text for c in r.choices}) > 1  # really sampled
    for choice in r.choices:
        assert set(choice.logprobs.tokens) <= pieces, choice.logprobs.tokens
        # logprobs are the raw model's (vLLM's default): outside tokens still rank first
        assert any(set(top) - pieces for top in choice.logprobs.top_logprobs)


def test_bad_words_chat_equals_offline_and_streams_the_same(client: OpenAI,
                                                            offline_llm) -> None:
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=30)
    word = "live"
    assert word in free.choices[0].message.content
    kwargs = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 30,
              "extra_body": {"bad_words": [word, "never used"]}}
    r = client.chat.completions.create(**kwargs)
    text = r.choices[0].message.content
    assert word not in text
    want = offline_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=30,
                                                     bad_words=[word, "never used"]))
    assert text == want[0].outputs[0].text
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: OpenAI, offline_llm) -> None:
    tok = offline_llm.engine.tokenizer
    long_prompt = "Numbers: " + ", ".join(str(i) for i in range(40)) + ". " + STORY
    ids = tok.encode(long_prompt)
    r = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0,
                                  max_tokens=6, echo=True,
                                  extra_body={"truncate_prompt_tokens": 12})
    assert r.usage.prompt_tokens == 12
    want = offline(offline_llm, ids[-12:], temperature=0, max_tokens=6)
    # echo shows the prompt the model saw: the kept tail
    assert r.choices[0].text == tok.decode(ids[-12:]) + want.text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_truncate_prompt_tokens_minus_one_fits_the_prompt_beside_max_tokens(
        client: OpenAI) -> None:
    huge = "word " * 3000  # > 2048 tokens: a 400 without truncation
    r = client.completions.create(model=MODEL, prompt=huge, max_tokens=8,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 2048 - 8
    chat = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": huge}], extra_body={"truncate_prompt_tokens": -1})
    assert chat.usage.prompt_tokens == 2048 - 1  # no max_tokens: one token held back (vLLM)
    assert chat.usage.completion_tokens == 1


@pytest.mark.parametrize(("path", "extra", "param", "match"), [
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ("/v1/completions", {"allowed_token_ids": [5, 10**6]}, "allowed_token_ids",
     "outside the vocabulary"),
    ("/v1/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids[0]", "must be in"),
    ("/v1/chat/completions", {"allowed_token_ids": ["5"]}, "allowed_token_ids", ""),
    ("/v1/chat/completions", {"allowed_token_ids": 5}, "allowed_token_ids", ""),
    ("/v1/completions", {"bad_words": "town"}, "bad_words", ""),
    ("/v1/completions", {"bad_words": [3]}, "bad_words", ""),
    ("/v1/chat/completions", {"bad_words": ["ok", " "]}, "bad_words[1]", "non-blank"),
    ("/v1/chat/completions", {"bad_words": [f"w{i}" for i in range(200)]}, "bad_words",
     "at most"),
    ("/v1/completions", {"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens",
     "larger than"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ""),
    ("/v1/completions", {"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens", ""),
    ("/v1/completions", {"truncate_prompt_tokens": 2040, "max_tokens": 100,
                         "prompt": "word " * 2100}, "max_tokens", "maximum context length"),
])
def test_bad_values_are_400s_naming_the_field(http: httpx.Client, path: str, extra: dict,
                                              param: str, match: str) -> None:
    body = ({"prompt": STORY} if path == "/v1/completions"
            else {"messages": MESSAGES}) | {"model": MODEL, "max_tokens": 4} | extra
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and match in error["message"], error
