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
