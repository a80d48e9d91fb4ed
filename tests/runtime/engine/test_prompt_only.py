"""Prompt-only requests (SamplingParams(max_tokens=0)): the prompt runs, scored with
prompt_logprobs when asked, and nothing is generated. Nothing runs past the prompt, so a
prompt may fill the whole context (lm-evaluation-harness's rolling loglikelihood windows of
max_length tokens; the server's echo with max_tokens 0).

A tiny random Llama against transformers in float32, max_model_len 32."""

from __future__ import annotations

import random

import pytest
from argosy_runtime import LLM, SamplingParams
from engine_helpers import assert_no_leaks

MAX_LEN = 32


@pytest.fixture(scope="module")
def llm(random_llama_dir):  # noqa: ANN001, ANN201
    return LLM(model=str(random_llama_dir), dtype="float32", block_size=4,
               max_model_len=MAX_LEN, max_num_batched_tokens=12)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def assert_prompt_logprobs_equal(out, ids: list[int], ref) -> None:  # noqa: ANN001
    want = ref.prompt_logprobs(ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, token in enumerate(ids[1:]):
        assert abs(out.prompt_logprobs[i + 1][token].logprob - want[i, token].item()) < 1e-4


def test_a_whole_context_prompt_is_scored(llm, random_llama_hf) -> None:  # noqa: ANN001
    """32 tokens in a 32-token context, in chunks of 12: every prompt token's logprob equals
    transformers'; no token, finish_reason length; n = 2 gives two such sequences."""
    ids = prompt(1, MAX_LEN)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2, n=2)
    out = llm.generate([ids], params)[0]
    assert out.finished and [s.token_ids for s in out.outputs] == [[], []]
    assert [s.finish_reason for s in out.outputs] == ["length", "length"]
    assert [s.text for s in out.outputs] == ["", ""]
    assert_prompt_logprobs_equal(out, ids, random_llama_hf)
    # A generating request needs room for its token: the same prompt is refused.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ids], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ids + [5]], SamplingParams(max_tokens=0))
    assert_no_leaks(llm.engine)


def test_beside_generating_requests(llm, random_llama_hf) -> None:  # noqa: ANN001
    """Prompt-only requests in the same batch as generating ones (with and without prompt
    logprobs, one from the prefix cache): the generating ones' tokens are those they get
    alone, and the prefix-cached one still finishes without a token."""
    gen_ids, score_ids = prompt(2, 10), prompt(3, 20)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate([gen_ids], greedy)[0].outputs[0].token_ids
    llm.generate([score_ids], SamplingParams(max_tokens=0))  # its blocks now cached
    outs = llm.generate([gen_ids, score_ids, score_ids],
                        [greedy, SamplingParams(max_tokens=0),
                         SamplingParams(max_tokens=0, prompt_logprobs=0)])
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].token_ids == [] and outs[1].num_cached_tokens > 0
    assert outs[1].prompt_logprobs is None
    assert outs[2].outputs[0].token_ids == []
    assert_prompt_logprobs_equal(outs[2], score_ids, random_llama_hf)
    assert_no_leaks(llm.engine)


def test_no_drafts_for_a_prompt_only_request(random_llama_dir, random_llama_hf) -> None:  # noqa: ANN001
    """With n-gram speculation on, a repetitive prompt (drafts would match) is still only
    scored."""
    llm = LLM(model=str(random_llama_dir), dtype="float32", block_size=4,
              max_model_len=MAX_LEN, speculative="ngram")
    ids = prompt(4, 6) * 5
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids == []
    assert llm.engine.get_stats().spec_decode_num_draft_tokens == 0
    assert_prompt_logprobs_equal(out, ids, random_llama_hf)
    assert_no_leaks(llm.engine)
