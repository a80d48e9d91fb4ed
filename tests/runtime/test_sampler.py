"""Sampler edge cases that need no model."""

from __future__ import annotations

import pytest
import torch
from argosy_runtime.request import Request
from argosy_runtime.sampler import Sampler
from argosy_runtime.sampling_params import SamplingParams

VOCAB = 50


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-40, 1e-46])
def test_a_tiny_temperature_picks_the_most_likely_token(temperature: float) -> None:
    """Logits divided by ~1e-38 or less overflow float32 (1e-46 is 0 there): the softmax of
    infs is NaN, and every step sampled token 0 instead of the near-certain argmax."""
    logits = torch.linspace(-30.0, 30.0, VOCAB)[None, :].roll(7, dims=1)
    best = int(logits.argmax())
    assert best != 0
    request = Request("r", [1, 2, 3], SamplingParams(temperature=temperature, max_tokens=4),
                      max_tokens=4)
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(0))
    assert sampler(logits, [request]) == [best]


def _request(name: str, **params: object) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(max_tokens=4, **params), max_tokens=4)


@pytest.mark.parametrize("top_k", [0, 40000])
def test_a_row_without_top_p_samples_the_same_distribution_beside_a_top_p_row(
        top_k: int) -> None:
    """The nucleus mask ran on every row once any row used top-k or top-p: a row with
    top_p=1 lost its tail wherever the float32 cumsum reached 1.0 early (thousands of tokens
    for a flat distribution), so its distribution, and a seeded request's tokens, depended on
    what else was in the batch."""
    vocab = 49152
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = Sampler(vocab)
    plain = _request("plain", top_k=top_k)
    alone = sampler.probs(logits[:1], [plain])
    beside = sampler.probs(logits, [plain, _request("nucleus", top_p=0.5)])
    assert torch.equal(alone[0], beside[0])
    assert int((alone[0] > 0).sum()) == (top_k or vocab)


def test_logit_bias_is_added_before_the_repetition_penalty() -> None:
    """vLLM (and transformers' generate) add logit_bias first and penalize the biased logit:
    a prompt token at -2 with bias +4 is at +2, which repetition_penalty=2 halves to 1.
    Penalizing first (-4) and adding the bias after gave 0, another distribution."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = -2.0
    request = _request("r", repetition_penalty=2.0, logit_bias={5: 4.0})  # prompt [1, 2, 3]
    request.token_ids.append(5)  # generated once: a seen token
    processed = Sampler(VOCAB).process(logits, [request])
    assert processed[0, 5].item() == pytest.approx(1.0)
    assert processed[0, 1].item() == 0.0  # a seen prompt token at 0 stays 0


@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (2, 1.0), (2, 0.99)])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k: int, top_p: float) -> None:
    """vLLM and transformers' TopKLogitsWarper mask only logits strictly below the k-th
    largest, so tokens tied with it stay (half-precision logits tie often). The mask was by
    sorted position: of three tokens tied for first, top_k=1 always sampled whichever the
    sort put first, never the other two."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, [7, 19, 33]] = 3.0  # three-way tie for the best logit
    logits[0, 4] = 1.0
    probs = Sampler(VOCAB).probs(logits, [_request("r", top_k=top_k, top_p=top_p)])[0]
    assert (probs > 0).nonzero().flatten().tolist() == [7, 19, 33]
    assert probs[7] == probs[19] == probs[33]
