"""Cascade rules: which model answers first, and the confidence check's arithmetic."""

from __future__ import annotations

import pytest
from argosy_runtime.gateway import cascade as c
from argosy_runtime.gateway.config import CascadeConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def route() -> CascadeConfig:
    return CascadeConfig(
        name="auto",
        small="tiny",
        large="big",
        prompt_chars_over=200,
        max_tokens_over=256,
        keywords=("Prove", "step by step"),
        min_mean_logprob=-1.0,
    )


def chat(text: str, **extra: object) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": text}], **extra}


def test_default_is_small_with_confidence_check(route: CascadeConfig) -> None:
    d = c.decide(route, CHAT, chat("hello there"), {})
    assert (d.tier, d.model, d.reason, d.check_confidence) == ("small", "tiny", "default", True)


def test_streamed_small_answers_skip_the_confidence_check(route: CascadeConfig) -> None:
    d = c.decide(route, CHAT, chat("hello", stream=True), {})
    assert d.tier == "small" and not d.check_confidence


def test_beam_searches_skip_the_confidence_check(route: CascadeConfig) -> None:
    # the check asks for logprobs, which a beam search refuses (400)
    d = c.decide(route, CHAT, chat("hello", use_beam_search=True, n=2), {})
    assert d.tier == "small" and not d.check_confidence


def test_header_forces_either_tier(route: CascadeConfig) -> None:
    long_prompt = "x" * 500
    assert c.decide(route, CHAT, chat("hi"), {"x-argosy-cascade": "large"}).reason == "header"
    d = c.decide(route, CHAT, chat(long_prompt), {"x-argosy-cascade": "Small"})
    # Forced: the small model's answer stands, so it is not checked (nor escalated).
    assert (d.tier, d.reason, d.check_confidence) == ("small", "header", False)
    d = c.decide(route, CHAT, chat("hi"), {}, forced_tier="small")
    assert (d.tier, d.reason, d.check_confidence) == ("small", "model_name", False)


def test_model_name_suffix(route: CascadeConfig) -> None:
    assert c.split_route_name("auto:large") == ("auto", "large")
    assert c.split_route_name("org/model:v2") == ("org/model:v2", None)
    d = c.decide(route, CHAT, chat("hi"), {}, forced_tier="large")
    assert (d.tier, d.model, d.reason) == ("large", "big", "model_name")


def test_prompt_length_threshold_is_strict(route: CascadeConfig) -> None:
    # The flattened chat adds role and separators: measure a completion prompt instead.
    at = {"model": "auto", "prompt": "y" * 200}
    over = {"model": "auto", "prompt": "y" * 201}
    assert c.decide(route, COMPLETIONS, at, {}).tier == "small"
    d = c.decide(route, COMPLETIONS, over, {})
    assert (d.tier, d.reason) == ("large", "prompt_length")


def test_max_tokens_threshold(route: CascadeConfig) -> None:
    assert c.decide(route, CHAT, chat("hi", max_tokens=256), {}).tier == "small"
    d = c.decide(route, CHAT, chat("hi", max_completion_tokens=257), {})
    assert (d.tier, d.reason) == ("large", "max_tokens")


def test_keywords_case_insensitive_anywhere_in_history(route: CascadeConfig) -> None:
    body = {
        "model": "auto",
        "messages": [
            {"role": "system", "content": "Think STEP BY STEP."},
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        ],
    }
    d = c.decide(route, CHAT, body, {})
    assert (d.tier, d.reason) == ("large", "keyword")
    assert c.decide(route, COMPLETIONS, {"prompt": "please prove it"}, {}).reason == "keyword"


def test_keywords_are_searched_in_the_text_not_the_roles() -> None:
    route = CascadeConfig(name="auto", small="tiny", large="big", keywords=("system", "user"))
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "hi"}]}
    assert c.decide(route, CHAT, body, {}).reason == "default"
    # The Responses API's `instructions` become a system turn: not a keyword either.
    assert c.decide(route, "/v1/responses", {"instructions": "Be brief.", "input": "hi"},
                    {}).reason == "default"
    body["messages"][1]["content"] = "Which user groups exist?"
    assert c.decide(route, CHAT, body, {}).reason == "keyword"


def test_no_rules_means_small_without_check() -> None:
    plain = CascadeConfig(name="auto", small="tiny", large="big")
    d = c.decide(plain, CHAT, chat("x" * 10_000, max_tokens=10_000), {})
    assert (d.tier, d.reason, d.check_confidence) == ("small", "default", False)


def test_request_logprobs_adds_and_reports() -> None:
    body, added = c.request_logprobs(CHAT, chat("hi"))
    assert body["logprobs"] is True and added
    body, added = c.request_logprobs(CHAT, chat("hi", logprobs=True))
    assert not added
    body, added = c.request_logprobs(COMPLETIONS, {"prompt": "x"})
    assert body["logprobs"] == 0 and added
    _, added = c.request_logprobs(COMPLETIONS, {"prompt": "x", "logprobs": 2})
    assert not added


def test_mean_logprob_both_shapes() -> None:
    completion = {"choices": [{"logprobs": {"token_logprobs": [-1.0, -2.0, None, -3.0]}}]}
    assert c.mean_logprob(completion) == pytest.approx(-2.0)
    chat_resp = {"choices": [{"logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.5}]}}]}
    assert c.mean_logprob(chat_resp) == pytest.approx(-1.0)
    assert c.mean_logprob({"choices": [{"logprobs": None}]}) is None
    assert c.mean_logprob({"choices": []}) is None
    assert c.mean_logprob({"choices": [{"logprobs": {"content": []}}]}) is None
    # A batch (or n > 1): the least confident answer decides; the first alone let a batch
    # whose other answers the small model was unsure of stand.
    batch = {"choices": [{"logprobs": {"token_logprobs": [-0.1]}},
                         {"logprobs": {"token_logprobs": [-3.0, -1.0]}},
                         {"logprobs": None}]}
    assert c.mean_logprob(batch) == pytest.approx(-2.0)


def test_strip_logprobs() -> None:
    resp = {"choices": [{"text": "a", "logprobs": {"token_logprobs": [-1]}}]}
    assert c.strip_logprobs(resp)["choices"][0] == {"text": "a", "logprobs": None}
