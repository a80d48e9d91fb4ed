"""Review fixes of the cascade's up-front rules: each test fails without its fix."""

from __future__ import annotations

import pytest
from argosy_runtime.gateway import cascade as c
from argosy_runtime.gateway.config import CascadeConfig

COMPLETIONS = "/v1/completions"


@pytest.fixture
def route() -> CascadeConfig:
    return CascadeConfig(name="auto", small="tiny", large="big", prompt_chars_over=200,
                         keywords=("prove",), min_mean_logprob=-1.0)


def test_echoed_completions_skip_the_confidence_check(route: CascadeConfig) -> None:
    """With echo, the answer's token_logprobs start with the prompt's own: their mean judges
    how surprising the prompt was, not how confident the answer is."""
    d = c.decide(route, COMPLETIONS, {"prompt": "hello", "echo": True}, {})
    assert (d.tier, d.reason, d.check_confidence) == ("small", "default", False)
    assert c.decide(route, COMPLETIONS, {"prompt": "hello", "echo": False}, {}).check_confidence


def test_every_prompt_of_a_completions_batch_is_judged(route: CascadeConfig) -> None:
    """Each prompt of a batch is answered by the model picked: a long prompt, or one with a
    keyword, is not hidden behind a short first one."""
    d = c.decide(route, COMPLETIONS, {"prompt": ["short", "y" * 201]}, {})
    assert (d.tier, d.reason) == ("large", "prompt_length")
    d = c.decide(route, COMPLETIONS, {"prompt": ["short", "please Prove it"]}, {})
    assert (d.tier, d.reason) == ("large", "keyword")
    # A keyword never spans two prompts, and token ids are one prompt, not a batch.
    assert c.decide(route, COMPLETIONS, {"prompt": ["pro", "ve"]}, {}).reason == "default"
    assert c.decide(route, COMPLETIONS, {"prompt": [1, 2, 3]}, {}).reason == "default"
    assert c.decide(route, COMPLETIONS, {"prompt": [[1, 2], [3] * 150]}, {}).reason \
        == "prompt_length"
