"""Speculation against plain decoding, request features mixed in one batch, under a KV pool
tight enough to preempt: stop tokens and stop strings hit inside accepted runs, max_tokens,
logprobs and prompt_logprobs, n > 1, penalties, min_tokens, an int8 KV cache. Greedy
requests must give the same tokens, text, finish reasons and logprobs; seeded sampled ones
with n-gram drafts the same tokens (docs/speculative.md); both pools end empty."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from engine_helpers import assert_no_leaks, run_requests  # noqa: E402
from model_factory import make_scripted_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 2048  # bytes of a float32 block of 4 tokens of the 2-layer random model


def summary(outputs: list) -> list:
    """Per sequence: tokens, text, finish reason, and each chosen token's logprob and rank
    (rounded: a verification pass computes a position in a wider batch)."""
    return [(c.token_ids, c.text, c.finish_reason,
             None if c.logprobs is None else
             [(round(lp[t].logprob, 3), lp[t].rank) for lp, t in zip(c.logprobs, c.token_ids)])
            for out in outputs for c in out.outputs]


@pytest.fixture(scope="module")
def greedy_requests(target_and_copy: dict[str, Path]) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing a prefix; stops placed inside each plain output, read off a first
    plain run (so they fall after the first drafts were accepted)."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 49152) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(3, 9))]
               for _ in range(6)]
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = run_requests(LLMEngine(model=str(target_and_copy["target"]), dtype="float32"),
                         [(p, free) for p in prompts])
    tokens = [o.outputs[0].token_ids for o in plain]
    texts = [o.outputs[0].text for o in plain]
    return [
        (prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                    stop_token_ids=[tokens[0][7]])),
        (prompts[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                    stop=[texts[1][len(texts[1]) // 3:][:3]])),
        (prompts[2], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)),
        (prompts[3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                    repetition_penalty=1.3, frequency_penalty=0.5,
                                    presence_penalty=0.3)),
        (prompts[4], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2,
                                    include_stop_str_in_output=True,
                                    stop=[texts[4][len(texts[4]) // 2:][:2]])),
        (prompts[5], SamplingParams(max_tokens=20, temperature=0, min_tokens=5, logprobs=1,
                                    prompt_logprobs=1)),
    ]


# (speculative config, extra engine options, KV budget). A separate draft's cache takes a
# float32 page per target page from the budget. (No n-gram here: a random model's greedy
# output rarely repeats its prompt; the sampled test below drafts with n-grams.)
CONFIGS = {
    "self-draft": ({"method": "draft", "draft_layers": 1, "num_speculative_tokens": 3}, {},
                   14 * BLOCK),
    "copy": ({"method": "draft", "model": "copy", "num_speculative_tokens": 5}, {},
             14 * 2 * BLOCK),
    "copy-int8-kv": ({"method": "draft", "model": "copy", "num_speculative_tokens": 3},
                     {"kv_cache_dtype": "int8"}, 14 * 3 * BLOCK // 2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_features_under_preemption_equal_plain_decoding(
        name: str, target_and_copy: dict[str, Path], greedy_requests: list) -> None:  # noqa: ANN001
    spec, extra, budget = CONFIGS[name]
    spec = {**spec, "adaptive": False}
    if "model" in spec:
        spec["model"] = str(target_and_copy[spec["model"]])
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, **extra)
    plain = LLMEngine(model=str(target_and_copy["target"]), **options)
    expected = summary(run_requests(plain, greedy_requests))
    assert [s[2] for s in expected] == ["stop", "stop", "length", "length", "stop", "stop",
                                        "length"]
    engine = LLMEngine(model=str(target_and_copy["target"]), **options, speculative=spec,
                       kv_cache_memory=budget)
    assert summary(run_requests(engine, greedy_requests)) == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)


def test_seeded_sampling_with_ngram_drafts_and_request_features_equals_plain(
        tmp_path: Path) -> None:
    # A scripted model and a prompt that repeats its script: n-gram drafts are accepted and
    # rejected. With top-k, top-p, min-p, penalties, min_tokens, a stop token, logprobs and
    # n = 2, and preemption, each seeded sequence draws what it draws without speculation.
    folder = make_scripted_model_dir(tmp_path, 100, [200, 300, 400, 500, 600, 700])
    prompt = [5] + [100, 200, 300, 400, 500, 600, 700] * 2 + [100]
    variants = [
        dict(temperature=2.0, seed=3, n=2),
        dict(temperature=3.0, seed=4, top_k=5, logprobs=2),
        dict(temperature=2.0, seed=5, min_p=0.05, repetition_penalty=1.2),
        dict(temperature=2.0, seed=6, presence_penalty=0.5, frequency_penalty=0.3,
             stop_token_ids=[500]),
        dict(temperature=2.0, seed=7, top_p=0.8, min_tokens=3),
    ]
    requests = [(prompt[: 8 + i], SamplingParams(max_tokens=24, ignore_eos=i % 2 == 0, **v))
                for i, v in enumerate(variants)]
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=8,
                   kv_cache_memory=14 * BLOCK)
    expected = summary(run_requests(LLMEngine(model=str(folder), **options), requests))
    engine = LLMEngine(model=str(folder), **options, speculative={
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert summary(run_requests(engine, requests)) == expected
    stats = engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0
    assert_no_leaks(engine)
