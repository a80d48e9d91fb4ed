"""Beam search (argosy_runtime/beam_search.py) finds transformers' beams: the same hypotheses,
in the same order, with the same scores, through the engine (paged cache, prefix cache,
chunked prefill), with and without end tokens and length penalties."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLM, BeamSearchParams
from argosy_runtime.beam_search import BeamSearch, max_beam_width
from engine_helpers import FullForwardReference, assert_no_leaks

WIDTH, MAX_TOKENS = 3, 10


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(2, 14))] for _ in range(count)]


@torch.no_grad()
def hf_beams(model: torch.nn.Module, prompt: list[int], end_tokens: list[int] | None,
             length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """transformers' beams (generated tokens up to and including an end token, score)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=WIDTH,
                         num_return_sequences=WIDTH, max_new_tokens=MAX_TOKENS,
                         eos_token_id=end_tokens, pad_token_id=0, length_penalty=length_penalty,
                         return_dict_in_generate=True, output_scores=True)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        tokens = seq[len(prompt):].tolist()
        ends = [i for i, t in enumerate(tokens) if t in (end_tokens or ())]
        beams.append((tokens[:ends[0] + 1] if ends else tokens, float(score)))
    return beams


def assert_same_beams(got, expected) -> None:  # noqa: ANN001
    assert len(got.sequences) == len(expected)
    for seq, (tokens, score) in zip(got.sequences, expected):
        generated = seq.tokens[len(seq.tokens) - len(tokens):]
        assert generated == tokens
        assert seq.score == pytest.approx(score, abs=1e-4)


@pytest.fixture(scope="module")
def hf_model(random_llama_dir: Path) -> torch.nn.Module:
    return FullForwardReference.from_folder(random_llama_dir).model


def test_without_end_tokens_equals_transformers(random_llama_dir, hf_model) -> None:  # noqa: ANN001
    # block_size 4 and 8-token steps: beams share cached prefix blocks, prompts span chunks
    llm = LLM(model=str(random_llama_dir), dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    ps = prompts(1)
    outs = llm.beam_search(ps, BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS,
                                                ignore_eos=True))
    for p, out in zip(ps, outs):
        assert_same_beams(out, hf_beams(hf_model, p, None))
        for seq in out.sequences:
            assert seq.tokens[:len(p)] == p and len(seq.tokens) == len(p) + MAX_TOKENS
            assert seq.finish_reason == "length" and seq.stop_reason is None
            assert seq.score == pytest.approx(seq.cum_logprob / MAX_TOKENS)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens[len(p):])
    assert llm.engine.get_stats().prefix_cache_hits > 0  # steps reuse the beams' blocks
    assert_no_leaks(llm.engine)


@pytest.fixture(scope="module")
def ending_model(random_llama_dir: Path, hf_model, tmp_path_factory) -> tuple[Path, list[int]]:  # noqa: ANN001
    """The same weights with end tokens the beams meet: for each test prompt, the third token
    of transformers' second beam, so hypotheses finish early and compete with longer ones."""
    ends = sorted({2} | {hf_beams(hf_model, p, None)[1][0][2] for p in prompts(2)})
    folder = tmp_path_factory.mktemp("ending") / "model"
    shutil.copytree(random_llama_dir, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = ends
        (folder / name).write_text(json.dumps(config))
    return folder, ends


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_end_tokens_and_length_penalty_equal_transformers(ending_model, hf_model,  # noqa: ANN001
                                                          length_penalty: float) -> None:
    folder, ends = ending_model
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    assert llm.engine.end_token_ids == frozenset(ends)
    ps = prompts(2)
    outs = llm.beam_search(ps, BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS,
                                                length_penalty=length_penalty))
    stopped = 0
    for p, out in zip(ps, outs):
        assert_same_beams(out, hf_beams(hf_model, p, ends, length_penalty))
        for seq in out.sequences:
            generated = seq.tokens[len(p):]
            assert seq.score == pytest.approx(seq.cum_logprob / len(generated) ** length_penalty)
            if seq.finish_reason == "stop":
                stopped += 1
                assert seq.stop_reason == generated[-1] and generated[-1] in ends
                assert seq.text == llm.get_tokenizer().decode(generated[:-1])
    if length_penalty <= 1.0:
        assert stopped  # the end tokens were met: the finishing path ran
    else:  # a strong length penalty ranks the full-length beams above the early ends
        assert not stopped
    assert_no_leaks(llm.engine)


def test_widths_limited_by_the_log_probabilities_per_request() -> None:
    assert max_beam_width(0) == 10 and max_beam_width(1) == 10 and max_beam_width(3) == 5
    with pytest.raises(ValueError, match="beam_width must be at most 6 .*2 end token"):
        BeamSearch([1, 2], BeamSearchParams(beam_width=7, max_tokens=4), [2, 7])
    BeamSearch([1, 2], BeamSearchParams(beam_width=7, max_tokens=4, ignore_eos=True), [2, 7])
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=True, max_tokens=4), dict(beam_width=2, max_tokens=4,
                                                          length_penalty="1")):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)



@pytest.mark.parametrize(("bad", "field"), [
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty=float("inf")), "length_penalty"),
    (dict(ignore_eos="false"), "ignore_eos"),
    (dict(ignore_eos=None), "ignore_eos"),
])
def test_bad_length_penalty_or_ignore_eos_is_a_clear_error(bad: dict, field: str) -> None:
    """A NaN length_penalty scored every hypothesis NaN (the ranking and the stop rule then
    meant nothing), and ignore_eos="false" was truthy: end tokens silently ignored."""
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(beam_width=2, max_tokens=4, **bad)


def test_prompt_too_long_is_a_clear_error(random_llama_dir) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_llama_dir), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.beam_search([list(range(3, 30))], BeamSearchParams(beam_width=2, max_tokens=8))
    assert_no_leaks(llm.engine)


class _Tokens:
    @staticmethod
    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_stops_once_the_finished_beams_cannot_be_beaten() -> None:
    # Width 2, end token 9: two hypotheses finish by step 2, and the best live beam's score
    # (-2.5 / 2) is below the worst finished one (-0.8 / 2): no step 3, though max_tokens is 10.
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=10), [9])
    assert search.num_candidates == 4 and search.requests() == [[1]]
    search.advance([{9: -0.1, 5: -0.5, 6: -0.7, 7: -3.0}])
    assert not search.done and search.requests() == [[1, 5], [1, 6]]
    search.advance([{9: -0.2, 1: -2.0, 3: -2.5, 4: -2.6}, {9: -0.1, 1: -3.0, 3: -3.1, 4: -3.2}])
    assert search.done
    out = search.output(_Tokens())
    assert [(s.tokens, s.text, s.finish_reason, s.stop_reason) for s in out.sequences] == [
        ([1, 9], "", "stop", 9), ([1, 5, 9], "5", "stop", 9)]
    assert [s.score for s in out.sequences] == pytest.approx([-0.1, -0.7 / 2])
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([-0.1, -0.7])


def test_only_the_best_width_candidates_may_finish() -> None:
    # The end token is the 3rd candidate of a width-2 search: a spare, not a hypothesis.
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=3), [9])
    search.advance([{5: -0.1, 6: -0.2, 9: -0.3, 7: -0.4}])
    assert not search.finished and search.requests() == [[1, 5], [1, 6]]


@pytest.mark.parametrize("penalty", [100.0, -100.0])
def test_extreme_length_penalties_past_a_floats_range_still_finish(penalty: float) -> None:
    """1300 ** 100 overflows a float and 1300 ** -100 is 0.0: the score is then its limit
    (0 or -inf) instead of an OverflowError or ZeroDivisionError ending the search."""
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=1300,
                                              length_penalty=penalty), [2])
    while not search.done:
        search.advance([{5: -0.1, 6: -0.2}])
    [best] = search.output(_Tokens()).sequences
    assert len(best.tokens) == 1301 and best.finish_reason == "length"
    assert best.score == (0.0 if penalty > 0 else -math.inf)
