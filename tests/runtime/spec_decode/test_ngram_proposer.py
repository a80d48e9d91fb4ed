from __future__ import annotations

from argosy_runtime.spec_decode.ngram_proposer import NgramProposer


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    p = NgramProposer(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 6, 7]
    # Suffix [6, 7] (n=3 [4, 6, 7] has no earlier match); latest earlier match at 7..8 -> 3, 4
    assert p.propose(tokens, 2) == [3, 4]
    assert p.propose(tokens, 5) == [3, 4, 6, 7]


def test_prefers_longer_ngrams() -> None:
    p = NgramProposer(1, 3)
    tokens = [1, 2, 3, 10, 9, 2, 3, 20, 1, 2, 3]
    assert p.propose(tokens, 1) == [10]  # [1, 2, 3] matched, not the later [2, 3]


def test_no_match_proposes_nothing() -> None:
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramProposer(1, 4).propose([7], 4) == []
