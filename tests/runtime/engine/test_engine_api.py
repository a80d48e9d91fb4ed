"""LLMEngine behaviour beyond greedy exactness: bad input, aborts, sampling options, n > 1."""

from __future__ import annotations

import random

import pytest
from argosy_runtime import LLM, LLMEngine, SamplingParams
from engine_helpers import assert_no_leaks


@pytest.fixture(scope="module")
def engine(random_llama_dir) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                     max_model_len=256, kv_cache_memory=256 * 4 * 512)


def drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("prompt,field", [
    ("", "prompt"), ([], "prompt"), ([1, 2, 10**6], "prompt[2]"), ([1, -1], "prompt[1]"),
    ([1, "x"], "prompt[1]"), ([5] * 300, "max_model_len"),
])
def test_bad_prompts_raise_value_errors_and_others_keep_running(engine, prompt, field) -> None:  # noqa: ANN001
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=8))
    done = drain(engine)
    assert len(done["good"].outputs[0].token_ids) == 6
    assert "bad" not in done
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"), ({"n": 0}, "n"), ({"n": 1000}, "n"),
    ({"logprobs": 10**6}, "logprobs"), ({"temperature": float("nan")}, "temperature"),
    ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"top_k": -5}, "top_k"), ({"presence_penalty": 9.0}, "presence_penalty"),
])
def test_absurd_sampling_values_name_the_field(kwargs, field) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_larger_than_the_pool_is_rejected_up_front(random_llama_dir) -> None:  # noqa: ANN001
    tiny = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                     kv_cache_memory=4 * 4 * 512)  # 4 blocks = 16 tokens
    with pytest.raises(ValueError, match="whole pool"):
        tiny.add_request("big", [5] * 10, SamplingParams(max_tokens=10))
    tiny.add_request("fits", [5] * 4, SamplingParams(max_tokens=8, temperature=0))
    assert len(drain(tiny)["fits"].outputs[0].token_ids) == 8


def test_duplicate_request_id_is_rejected(engine) -> None:  # noqa: ANN001
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    drain(engine)


@pytest.mark.parametrize("first,second", [(("par", 2), ("par#1", 1)), (("par#1", 1), ("par", 2))])
def test_request_id_of_another_requests_sequence_is_rejected(engine, first, second) -> None:  # noqa: ANN001
    """n > 1 runs sequences "<id>#<i>", which key the scheduler and the block tables: a request
    named like a live one (either way round) would share its block table and overwrite it."""
    (id1, n1), (id2, n2) = first, second
    alone = {}
    for rid, n in (first, second):
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, n=n))
        alone[rid] = [c.token_ids for c in drain(engine)[rid].outputs]
    engine.add_request(id1, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, n=n1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(id2, [9, 8], SamplingParams(max_tokens=4, temperature=0, n=n2))
    assert [c.token_ids for c in drain(engine)[id1].outputs] == alone[id1]
    assert_no_leaks(engine)


def test_abort_mid_generation_frees_blocks_at_once(engine) -> None:  # noqa: ANN001
    for i in range(4):
        engine.add_request(f"a{i}", [9 + i] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.usage() > 0
    engine.abort_request(["a0", "a1", "a2", "a3", "unknown-id"])
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


def test_stop_token_ids_stop_strings_and_min_tokens(engine, random_llama_hf) -> None:  # noqa: ANN001
    prompt = [11, 22, 33, 44]
    ref = random_llama_hf.greedy(prompt, 12)
    engine.add_request("stop-id", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                         stop_token_ids=[ref[3]], ignore_eos=True))
    out = drain(engine)["stop-id"].outputs[0]
    first = ref.index(ref[3])
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[3]

    full_text = engine.tokenizer.decode(ref)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    engine.add_request("stop-str", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                          stop=[stop], ignore_eos=True))
    out = drain(engine)["stop-str"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full_text.startswith(out.text)

    engine.add_request("min", prompt, SamplingParams(max_tokens=6, min_tokens=6, temperature=0,
                                                     stop_token_ids=[ref[0]]))
    out = drain(engine)["min"].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_a_stop_tokens_text_is_output_only_with_include_stop_str_in_output(
        engine, random_llama_hf) -> None:  # noqa: ANN001
    """As vLLM: the token that stops a request (a `stop_token_ids` one, like EOS) is in
    token_ids but its text is not, unless include_stop_str_in_output."""
    prompt = [11, 22, 33, 44]
    ref = random_llama_hf.greedy(prompt, 12)
    decode = engine.tokenizer.decode
    # A stop token with text of its own, first seen where it stops
    i = next(i for i in range(1, 12) if ref[i] not in ref[:i]
             and len(decode(ref[: i + 1])) > len(decode(ref[:i])))
    texts = {}
    for include in (False, True):
        engine.add_request(f"stop-{include}", prompt, SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[ref[i]], ignore_eos=True,
            include_stop_str_in_output=include))
        out = drain(engine)[f"stop-{include}"].outputs[0]
        assert out.token_ids == ref[: i + 1] and out.stop_reason == ref[i]
        texts[include] = out.text
    assert texts == {False: decode(ref[:i]), True: decode(ref[: i + 1])}


def test_the_stop_string_found_first_in_the_text_ends_it(engine, random_llama_hf) -> None:  # noqa: ANN001
    """Two stop strings in one token's text: the output ends before the first to appear in
    the text (whatever their order in `stop`), so it holds no stop string (OpenAI's rule)."""
    prompt = [11, 22, 33, 44]
    ref = random_llama_hf.greedy(prompt, 12)
    decode = engine.tokenizer.decode

    def two_new_chars(j: int) -> tuple[str, str, str] | None:
        before = decode(ref[:j])
        delta = decode(ref[: j + 1])[len(before):]
        new = [c for k, c in enumerate(delta) if c not in before and c not in delta[:k]]
        return (before + delta[: delta.index(new[0])], new[0], new[1]) if len(new) > 1 else None

    expected, earlier, later = next(f for j in range(12) if (f := two_new_chars(j)))
    engine.add_request("stops", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                       stop=[later, earlier], ignore_eos=True))
    out = drain(engine)["stops"].outputs[0]
    assert out.stop_reason == earlier and out.text == expected


def test_prefix_cache_hits_stay_within_one_cache_salt(engine) -> None:  # noqa: ANN001
    """vLLM's cache_salt: a prompt cached under one salt (or none) is no hit under another,
    and is under its own."""
    prompt = [(5 * i + 3) % 200 + 10 for i in range(37)]  # 9 full blocks of 4 + 1 token

    def cached_tokens(request_id: str, salt: str | None) -> int:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0,
                                                              cache_salt=salt))
        return drain(engine)[request_id].num_cached_tokens

    assert cached_tokens("plain", None) == 0
    assert cached_tokens("plain-again", None) == 36
    assert cached_tokens("tenant-a", "tenant-a") == 0
    assert cached_tokens("tenant-b", "tenant-b") == 0
    assert cached_tokens("tenant-a-again", "tenant-a") == 36
    assert_no_leaks(engine)


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(engine) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7, n=3)
    engine.add_request("s1", [3, 4, 5], params)
    first = drain(engine)["s1"]
    engine.add_request("noise", [8, 9], SamplingParams(max_tokens=5, temperature=1.0))
    engine.add_request("s2", [3, 4, 5], params)
    second = drain(engine)["s2"]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len(first.outputs) == 3 and [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert_no_leaks(engine)


def test_top_k_one_equals_greedy_and_penalties_change_output(engine, random_llama_hf) -> None:  # noqa: ANN001
    prompt = [101, 202, 303]
    engine.add_request("k1", prompt, SamplingParams(max_tokens=10, temperature=0.9, top_k=1,
                                                    ignore_eos=True))
    assert drain(engine)["k1"].outputs[0].token_ids == random_llama_hf.greedy(prompt, 10)
    engine.add_request("rep", prompt, SamplingParams(max_tokens=30, temperature=0,
                                                     repetition_penalty=5.0, ignore_eos=True))
    tokens = drain(engine)["rep"].outputs[0].token_ids
    greedy = random_llama_hf.greedy(prompt, 30)
    # A strong repetition penalty repeats fewer tokens than plain greedy does.
    assert len(set(tokens)) >= len(set(greedy)) and tokens != greedy or len(set(greedy)) == 30


def test_llm_generate_keeps_prompt_order(random_llama_dir, random_llama_hf) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_llama_dir), dtype="float32", block_size=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=3))
    assert_no_leaks(llm.engine)


def test_llm_generate_aborts_its_requests_when_a_step_raises(random_llama_dir,  # noqa: ANN001
                                                               monkeypatch) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_llama_dir), dtype="float32", block_size=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    execute = runner.execute
    calls = 0

    def fail_once(sched):  # noqa: ANN001, ANN202
        nonlocal calls
        calls += 1
        if calls == 3:  # mid-generation: the prompts are in, some tokens sampled
            raise RuntimeError("boom")
        return execute(sched)

    monkeypatch.setattr(runner, "execute", fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts, params)
    assert calls == 3
    assert_no_leaks(llm.engine)
    outs = llm.generate(prompts, params)  # nothing of the failed call left: same tokens
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_no_leaks(llm.engine)
