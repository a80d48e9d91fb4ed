"""Request validation on /v1/completions and /v1/chat/completions: OpenAI fields clients send
are accepted, and values the sampler cannot run are a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts an `argosy serve` process

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    proc = ServerProcess("--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            yield client
    finally:
        proc.stop()


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.mark.parametrize("path", [C, CHAT])
def test_stream_options_include_obfuscation_is_accepted(http: httpx.Client, path: str) -> None:
    # OpenAI's stream_options field on chat and completions (as on /v1/responses): it was an
    # "unknown field" 400. No obfuscation field is added to the chunks.
    body = {"prompt": "x"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "model": MODEL, "max_tokens": 2, "stream": True,
                              "stream_options": {"include_usage": True,
                                                 "include_obfuscation": False}})
    assert r.status_code == 200, r.text
    assert "obfuscation" not in r.text and '"usage":{"prompt_tokens"' in r.text, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    # still a 400 without stream, as the rest of stream_options
    r = http.post(path, json={**body, "max_tokens": 2,
                              "stream_options": {"include_obfuscation": True}})
    assert _error(r)["param"] == "stream_options"


def test_openai_end_user_and_cache_key_fields_are_accepted_on_chat(http: httpx.Client) -> None:
    # `safety_identifier` replaces `user`, which is accepted; `prompt_cache_key` is a hint
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "user": "u",
                              "safety_identifier": "hashed-user", "prompt_cache_key": "k"})
    assert r.status_code == 200, r.text
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2, "safety_identifier": 5})
    assert _error(r)["param"] == "safety_identifier"


def test_a_reply_message_sent_back_as_the_client_got_it_is_accepted(http: httpx.Client) -> None:
    # openai's `message.model_dump()` of a reply (ours, vLLM's or OpenAI's) sets every field:
    # annotations, audio and function_call were unknown fields, so the next turn was a 400.
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    reply = {**r.json()["choices"][0]["message"], "refusal": None, "annotations": None,
             "audio": None, "function_call": None, "tool_calls": None}
    history = [*MSG, reply, {"role": "user", "content": "and?"}]
    r = http.post(CHAT, json={"messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    cited = {**reply, "annotations": [{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "x", "start_index": 0, "end_index": 1}}]}
    r = http.post(CHAT, json={"messages": [*MSG, cited, history[-1]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    # an earlier audio reply or legacy function call cannot be shown to the model
    for field, value in (("audio", {"id": "audio_1"}),
                         ("function_call", {"name": "f", "arguments": "{}"})):
        r = http.post(CHAT, json={"messages": [*MSG, {**reply, field: value}, history[-1]],
                                  "max_tokens": 2})
        err = _error(r)
        assert err["param"] == "messages" and f"{field} of an earlier reply" in err["message"], err


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("penalty", [1e-300, 1e-38])
def test_a_repetition_penalty_that_overflows_the_logits_is_a_400(http: httpx.Client, path: str,
                                                                 penalty: float) -> None:
    # A seen token's logit / 1e-38 is inf in float32: the softmax was all NaN and every
    # token sampled was token 0 (<|endoftext|>), a 200 with an empty text.
    body = {"prompt": "the cat and the"} if path == C else {"messages": MSG}
    r = http.post(path, json={**body, "max_tokens": 4, "repetition_penalty": penalty})
    assert _error(r)["param"] == "repetition_penalty"
    r = http.post(path, json={**body, "max_tokens": 4, "repetition_penalty": 1e-6,
                              "temperature": 0})
    assert r.status_code == 200, r.text


def test_sampling_params_refuses_a_repetition_penalty_below_the_floor() -> None:
    from argosy_runtime.sampling_params import MIN_REPETITION_PENALTY, SamplingParams

    for bad in (0.0, 1e-300, MIN_REPETITION_PENALTY / 2):
        with pytest.raises(ValueError, match=r"^repetition_penalty must be in"):
            SamplingParams(repetition_penalty=bad)
    SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY)


def test_stop_strings_are_bounded_and_repeats_dropped(http: httpx.Client) -> None:
    # Each step scans every stop string on the engine thread: a million of them slowed every
    # request in the batch ~10x while this one ran.
    from argosy_runtime.sampling_params import MAX_STOP_STRINGS

    many = [f"zq{i}" for i in range(MAX_STOP_STRINGS + 1)]
    err = _error(http.post(C, json={"prompt": "x", "max_tokens": 2, "stop": many}))
    assert err["param"] == "stop" and str(MAX_STOP_STRINGS) in err["message"], err
    r = http.post(C, json={"prompt": "x", "max_tokens": 2, "stop": many[:-1] + ["zq0"] * 5000})
    assert r.status_code == 200, r.text


def test_a_bad_word_longer_than_a_phrase_is_a_400(http: httpx.Client) -> None:
    # The engine thread tokenizes bad words when it admits the request: 128 words of 100k
    # characters stalled every other request for ~6 s.
    from argosy_runtime.sampling_params import MAX_BAD_WORD_CHARS

    word = "lorem ipsum " * (MAX_BAD_WORD_CHARS // 12 + 1)
    err = _error(http.post(CHAT, json={"messages": MSG, "max_tokens": 2,
                                       "bad_words": ["ok", word]}))
    assert err["param"] == "bad_words[1]" and "characters" in err["message"], err
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 2,
                              "bad_words": [word[:MAX_BAD_WORD_CHARS]]})
    assert r.status_code == 200, r.text


def test_repeated_token_ids_are_dropped_in_order() -> None:
    # Each step tests the sampled token against stop_token_ids and indexes the logits with
    # allowed_token_ids: a 16 MiB body of one id repeated slowed every step of the batch.
    from argosy_runtime.sampling_params import SamplingParams

    params = SamplingParams(stop_token_ids=[7, 3, 7] * 1000, allowed_token_ids=[9, 2, 9, 2],
                            stop=["b", "a", "b"])
    assert params.stop_token_ids == [7, 3]
    assert params.allowed_token_ids == [9, 2]
    assert params.stop == ["b", "a"]
