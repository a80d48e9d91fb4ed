"""Misusing the Python API (`LLM`, `SamplingParams`, engine options) gets a ValueError or
TypeError naming the argument, raised at construction or at the call, and leaves the engine
serving: the next valid call works and every KV block is back in the pool. (Bad prompts,
sampling values and request sizes at the engine level: test_engine_api.py.)"""

from __future__ import annotations

import pytest
from argosy_runtime import LLM, PoolingParams, SamplingParams
from argosy_runtime.beam_search import BeamSearchParams
from argosy_runtime.engine_args import EngineArgs
from engine_helpers import assert_no_leaks

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", kv_cache_memory=16 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> str:
    return llm.generate(["Hello"], GREEDY)[0].outputs[0].text


def assert_still_serving(llm: LLM, reference: str) -> None:
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].text == reference
    assert_no_leaks(llm.engine)


# ---- engine options: refused when EngineArgs is built, before any model loads ----------

@pytest.mark.parametrize("kwargs,field", [
    ({"max_model_len": -5}, "max_model_len"),  # was a torch RuntimeError from the rope tables
    ({"max_model_len": "512"}, "max_model_len"),  # was a TypeError comparing str and int
    ({"block_size": 0}, "block_size"),  # was a ZeroDivisionError
    ({"seed": "x"}, "seed"),  # was a RuntimeError from torch.manual_seed
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),  # was silently the default
    ({"long_prefill_token_threshold": 0}, "long_prefill_token_threshold"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),  # was a TypeError naming nothing
    ({"kv_cache_memory_fraction": -1.0}, "kv_cache_memory_fraction"),  # was accepted
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),  # was truthy: caching on
    ({"served_model_name": ""}, "served_model_name"),  # was silently the model name
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"quantization": "fp8"}, "quantization"),  # was checked only after loading
    ({"cpu_threads": 100_000}, "cpu_threads"),  # was a segfault in the first matmul
])
def test_bad_engine_options_name_the_option_before_loading(kwargs, field, monkeypatch) -> None:  # noqa: ANN001
    import argosy_runtime.model_loader as loader

    def no_loading(*args, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("the model must not load for a bad option")

    monkeypatch.setattr(loader, "load_checkpoint", no_loading)
    with pytest.raises(ValueError, match=field):
        LLM(model="smollm2-135m", **kwargs)


def test_a_token_budget_below_max_model_len_without_chunking_is_refused_before_the_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The checkpoint's config is read (max_model_len comes from it), but its weights are not:
    # the refusal came only after the model had loaded.
    from argosy_runtime.engine import LLMEngine

    def no_weights(*args, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("the weights must not load for a bad option")

    monkeypatch.setattr(LLMEngine, "_load_model", no_weights)
    with pytest.raises(ValueError, match=r"without chunked prefill, max_num_batched_tokens \(64\)"):
        LLM(model="smollm2-135m", max_model_len=128, max_num_batched_tokens=64,
            enable_chunked_prefill=False)


def test_kv_cache_memory_takes_sizes_as_the_flag_does() -> None:
    assert EngineArgs(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20
    assert EngineArgs(kv_cache_memory=1e9).kv_cache_memory == 10**9


# ---- SamplingParams -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    ({"stop": 5}, "stop"),  # was TypeError: 'int' object is not iterable
    ({"stop": {"a": 1}}, "stop"),  # was accepted: the dict's keys became the stop strings
    ({"stop_token_ids": 5}, "stop_token_ids"),  # was TypeError: 'int' object is not iterable
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),  # None silently meant False
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
])
def test_sampling_params_of_the_wrong_type_name_the_field(kwargs, field) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_stop_as_a_string_or_tuple_still_works() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("x", "y"), stop_token_ids=(3,)).stop_token_ids == [3]


# ---- LLM calls ------------------------------------------------------------------------

@pytest.mark.parametrize("prompts", [None, 5, (p for p in ["hi"]), b"hi"])
def test_generate_with_prompts_of_the_wrong_type(llm, reference, prompts) -> None:  # noqa: ANN001
    # Were TypeError "'NoneType' object is not iterable", "'int' object is not subscriptable",
    # KeyError: 0 ...: nothing said it was `prompts`.
    with pytest.raises(TypeError, match="^prompts must be"):
        llm.generate(prompts, GREEDY)
    assert_still_serving(llm, reference)


def test_vllm_prompt_dicts_are_their_text_or_token_ids(llm, reference) -> None:  # noqa: ANN001
    ids = llm.get_tokenizer().encode("Hello")
    texts = [o.outputs[0].text for o in llm.generate(
        [{"prompt": "Hello"}, {"prompt_token_ids": ids},
         {"prompt": "Hello", "prompt_token_ids": ids}], GREEDY)]
    assert texts == [reference] * 3
    [one] = llm.generate({"prompt_token_ids": ids}, GREEDY)  # one dict is one prompt
    assert one.outputs[0].text == reference and one.prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt dict key\(s\) "
                                         r"\['multi_modal_data'\] are not supported"):
        llm.generate(["Hello", {"prompt": "hi", "multi_modal_data": {"image": None}}], GREEDY)
    with pytest.raises(ValueError, match=r"cache_salt.*SamplingParams\(cache_salt"):
        llm.generate({"prompt": "hi", "cache_salt": "x"}, GREEDY)
    with pytest.raises(ValueError, match=r"^prompts: a prompt dict needs 'prompt'"):
        llm.generate({}, GREEDY)
    assert_still_serving(llm, reference)


@pytest.mark.parametrize("params", [PoolingParams(), [PoolingParams()], {"max_tokens": 3},
                                    [GREEDY, {"max_tokens": 3}]])
def test_generate_with_params_of_the_wrong_type(llm, reference, params) -> None:  # noqa: ANN001
    # PoolingParams failed on len() with a TypeError naming nothing; a list of them silently
    # returned embeddings from generate.
    prompts = ["a", "b"] if isinstance(params, list) and len(params) == 2 else ["a"]
    with pytest.raises(TypeError, match="^params must be a SamplingParams"):
        llm.generate(prompts, params)
    assert_still_serving(llm, reference)


def test_embed_with_sampling_params_is_refused(llm, reference) -> None:  # noqa: ANN001
    # Was accepted: it generated text and returned outputs with no embedding.
    with pytest.raises(TypeError, match="^params must be a PoolingParams"):
        llm.embed(["a"], SamplingParams(max_tokens=3))
    assert_still_serving(llm, reference)


def test_which_prompt_is_wrong_is_named_and_none_of_the_call_runs(llm, reference) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"^prompts\[2\]: prompt \(\d+ tokens\) \+ max_tokens"):
        llm.generate(["fine", "also fine", "word " * 300], GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt must be"):
        llm.generate(["fine", None], GREEDY)
    with pytest.raises(ValueError, match=r"^prompt must not be empty"):  # one prompt: as is
        llm.generate("", GREEDY)
    assert_still_serving(llm, reference)


def test_beam_search_without_beam_search_params(llm, reference) -> None:  # noqa: ANN001
    # Was AttributeError: 'NoneType' object has no attribute 'ignore_eos'.
    with pytest.raises(TypeError, match="^params must be a BeamSearchParams"):
        llm.beam_search(["a"], SamplingParams())  # type: ignore[arg-type]
    assert llm.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences
    assert_still_serving(llm, reference)


@pytest.mark.parametrize("messages,where", [
    ("hello", "messages"),  # was jinja UndefinedError: 'str object' has no attribute 'role'
    ([{"role": "user"}], r"messages\[0\]"),  # was: 'dict object' has no attribute 'content'
    ([{"content": "hi"}], r"messages\[0\]"),
    ([[{"role": "user", "content": "hi"}], ["hi"]], r"messages\[1\]\[0\]"),
])
def test_chat_with_malformed_messages(llm, reference, messages, where) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=f"^{where} must be"):
        llm.chat(messages, GREEDY)
    assert_still_serving(llm, reference)


def test_score_with_texts_that_are_not_strings(llm, reference) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match="^text_1 must be"):
        llm.score(5, ["b"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^text_2 must be"):
        llm.score("a", ["b", [1, 2]])  # type: ignore[list-item]
    assert_still_serving(llm, reference)
