"""`LLM` as vLLM's `LLM` users call it: keyword names, logprob texts, and a call's own
requests only (the engine behind `LLM.engine` may hold others)."""

from __future__ import annotations

import pytest
from argosy_runtime import LLM, PoolingParams, SamplingParams
from argosy_runtime.beam_search import BeamSearchParams
from engine_helpers import assert_no_leaks

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", dtype="float32", kv_cache_memory=16 << 20,
               max_model_len=128)


def test_every_method_takes_vllms_keyword_names(llm: LLM) -> None:
    """vLLM's examples call llm.chat(conversation, sampling_params=..., use_tqdm=False) and
    llm.embed(prompts, pooling_params=...): those were TypeErrors (unexpected keyword)."""
    [by_name] = llm.chat(HI, sampling_params=GREEDY, use_tqdm=False)
    [plain] = llm.chat(HI, GREEDY)
    assert by_name.outputs[0].token_ids == plain.outputs[0].token_ids
    assert by_name.prompt == plain.prompt
    with pytest.raises(TypeError, match="not both"):
        llm.chat(HI, GREEDY, sampling_params=GREEDY)
    mean = PoolingParams(pooling="mean")
    [by_name] = llm.embed(["Hello there"], pooling_params=mean, use_tqdm=False)
    assert by_name.embedding == llm.embed(["Hello there"], mean)[0].embedding \
        != llm.embed(["Hi"])[0].embedding  # the params were used, not dropped
    with pytest.raises(TypeError, match="not both"):
        llm.embed(["Hi"], PoolingParams(), pooling_params=PoolingParams())
    assert len(llm.score("a", ["b", "c"], use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="classification head"):
        llm.classify(["Hi"], use_tqdm=False)  # the model's own refusal, not a TypeError
    [beams] = llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=2),
                              use_tqdm=False)
    assert len(beams.sequences) == 2
    assert_no_leaks(llm.engine)


def test_generate_returns_beside_a_request_added_on_the_engine(llm: LLM) -> None:
    """A request added on `llm.engine` directly (documented public) that finished first made
    generate's loop stop one output short: a KeyError, and the call's own request was left
    running in the engine, holding its KV blocks."""
    [want] = llm.generate(["The capital of France is"], GREEDY)
    llm.engine.add_request("mine", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    [out] = llm.generate(["The capital of France is"],
                         SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_logprobs_carry_their_decoded_token(llm: LLM) -> None:
    """vLLM fills Logprob.decoded_token in LLM.generate's outputs; it was always None."""
    tokenizer = llm.get_tokenizer()
    [out] = llm.generate(["The capital of France is"],
                         SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                        prompt_logprobs=1))
    seq = out.outputs[0]
    positions = [p for p in out.prompt_logprobs if p is not None] + seq.logprobs
    assert len(positions) == len(out.prompt_token_ids) - 1 + len(seq.token_ids)
    for position in positions:
        for token, lp in position.items():
            assert lp.decoded_token == tokenizer.decode([token], skip_special_tokens=False)
    assert "".join(p[t].decoded_token for p, t in zip(seq.logprobs, seq.token_ids)) \
        == seq.text
