"""Rejection sampling keeps the target distribution exactly (chi-square over 20,000 draws)."""

from __future__ import annotations

import pytest
import torch
from argosy_runtime.request import Request
from argosy_runtime.sampler import Sampler
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.spec_decode.rejection import verify_sampled

VOCAB = 12
DRAWS = 20_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test over the categories with non-zero expected mass."""
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives zero probability"
    stat = (((counts - expected) ** 2)[support] / expected[support]).sum()
    dof = int(support.sum()) - 1
    # chi2 survival function: regularized upper incomplete gamma Q(dof / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         stat.double() / 2.0))


@pytest.mark.parametrize("temperature,top_p,draft", [
    (1.0, 1.0, "model"), (0.7, 1.0, "model"), (1.5, 0.9, "model"), (1.0, 0.6, "ngram"),
    (0.5, 0.8, "ngram"),
])
def test_first_token_follows_the_target_distribution(temperature: float, top_p: float,
                                                     draft: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(1, VOCAB, generator=gen) * 0.6  # the target model's fixed logits
    request = Request("r", [1, 2, 3], SamplingParams(temperature=temperature, top_p=top_p,
                                                     max_tokens=4), max_tokens=4)
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(7))
    target = sampler.probs(sampler.process(logits, [request]), [request])[0]
    target = target / target.sum()
    draft_probs = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)  # a different q

    counts = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        if draft == "model":
            x = int(torch.multinomial(draft_probs, 1, generator=gen))
            q = draft_probs[None, :]
        else:  # deterministic proposer: always the same token, q = one-hot
            x, q = 3, None
        tokens = verify_sampled(
            lambda i, acc: sampler.probs(sampler.process(logits, [request]), [request])[0],
            [x], q,
            uniform=lambda: sampler.uniform(request),
            sample=lambda row: int(sampler.sample_from(row[None, :], [request])[0]),
        )
        counts[tokens[0]] += 1
    assert int((target > 0).sum()) >= 3  # a real test: several tokens in the support
    p_value = chi_square_p_value(counts, target)
    assert p_value > 0.001, (p_value, counts / DRAWS, target)


def test_a_biased_sampler_is_detected() -> None:
    # The test above can fail: sampling straight from the draft q is caught.
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)
    counts = torch.bincount(torch.multinomial(q, DRAWS, replacement=True, generator=gen),
                            minlength=VOCAB).float()
    assert chi_square_p_value(counts, target) < 0.001


def test_two_drafts_keep_the_joint_target_distribution() -> None:
    # k = 2 from a draft model: the target's and the draft's distributions at each position
    # depend on the tokens before it, and the second position is verified only after the
    # first draft was accepted. The first two output tokens (drawn by plain decoding's next
    # step when the first draft is rejected) must follow p(y0) p(y1 | y0).
    vocab, draws = 5, 40_000
    gen = torch.Generator().manual_seed(2024)
    p_logits = [torch.randn(vocab, generator=gen), torch.randn(vocab, vocab, generator=gen),
                torch.randn(vocab, vocab, vocab, generator=gen)]
    q_logits = [torch.randn(vocab, generator=gen), torch.randn(vocab, vocab, generator=gen)]

    def dist(logits: list[torch.Tensor], before: list[int]) -> torch.Tensor:
        return torch.softmax(logits[len(before)][tuple(before)], dim=-1)

    def draw(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=gen))

    counts = torch.zeros(vocab * vocab)
    for _ in range(draws):
        x0 = draw(dist(q_logits, []))
        x1 = draw(dist(q_logits, [x0]))
        out = verify_sampled(lambda i, acc: dist(p_logits, acc), [x0, x1],
                             torch.stack([dist(q_logits, []), dist(q_logits, [x0])]),
                             uniform=lambda: float(torch.rand((), generator=gen)),
                             sample=lambda row: draw(row / row.sum()))
        assert 1 <= len(out) <= 3 and out[:-1] == [x0, x1][: len(out) - 1]
        if len(out) == 1:  # the next step samples the second token from the target
            out.append(draw(dist(p_logits, out)))
        counts[out[0] * vocab + out[1]] += 1
    p0 = dist(p_logits, [])
    target = torch.cat([p0[y] * dist(p_logits, [y]) for y in range(vocab)])
    p_value = chi_square_p_value(counts, target)
    assert p_value > 0.001, (p_value, counts / draws, target)
    # The test has power at this size: the drafts' own joint distribution is caught.
    q_joint = torch.cat([dist(q_logits, [])[y] * dist(q_logits, [y]) for y in range(vocab)])
    assert chi_square_p_value(torch.multinomial(q_joint, draws, replacement=True,
                                                generator=gen).bincount(minlength=vocab * vocab)
                              .float(), target) < 0.001
