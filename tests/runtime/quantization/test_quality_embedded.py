"""Quality on the embedded SmolLM2-135M: perplexity on English text built at run time
(standard-library docstrings, disjoint from the GPTQ calibration modules) through the real
engine, for each quantization mode against bfloat16 — and greedy int8 text stays English.

Slow (each mode loads the model): about a minute per mode on a shared 2-core machine.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch
from argosy_runtime.cli.perplexity import perplexity

pytestmark = pytest.mark.slow

EVAL_MODULES = ("json", "argparse", "collections", "textwrap", "string", "functools",
                "itertools", "heapq", "random", "logging")
NUM_TOKENS = 1024
# Prefill in chunks of this many tokens: later chunks then read the earlier tokens' K/V back
# from the KV cache, so the int8 cache's rounding shows in the scores (a window prefilled in
# one chunk would attend only to its fresh, unquantized K/V).
CHUNK_TOKENS = 32
MODES = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4", "quantization_group_size": 128},
    "int8-kv": {"kv_cache_dtype": "int8"},
}
LIMITS = {"int8": 0.01, "int4": 0.08, "int8-kv": 0.01}


def eval_text() -> str:
    parts = []
    for name in EVAL_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            if doc and len(doc) >= 200:
                parts.append(doc)
    return "\n\n".join(parts)


def _int8_kv_supported() -> bool:
    from argosy_runtime.attention.torch_backend import TorchAttentionBackend

    return "k_scale" in inspect.signature(TorchAttentionBackend.forward).parameters


KV_CACHE_MEMORY = 64 << 20


def _cache_capacity(llm) -> dict:  # noqa: ANN001
    """What the engine really allocated for its KV cache in KV_CACHE_MEMORY bytes."""
    engine = llm.engine
    cc, runner = engine.cache_config, engine.runner
    allocated = runner.kv.nbytes
    scale_dtype = None
    if runner.kv_scales is not None:
        allocated += runner.scales.nbytes
        scale_dtype = runner.scales.dtype
    tokens = cc.num_blocks * cc.block_size
    return {"tokens": tokens, "bytes_per_token": allocated / tokens, "allocated": allocated,
            "scale_dtype": scale_dtype}


@pytest.fixture(scope="module")
def results() -> dict:
    """mode -> (LLM or None, perplexity result, KV-cache capacity), computed on first use."""
    cache: dict = {}

    def get(mode: str) -> dict:
        if mode not in cache:
            from argosy_runtime import LLM

            llm = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=KV_CACHE_MEMORY,
                      enable_prefix_caching=False, max_num_batched_tokens=CHUNK_TOKENS,
                      **MODES[mode])
            capacity = _cache_capacity(llm)
            ids = llm.get_tokenizer().encode(eval_text())[:NUM_TOKENS]
            cache[mode] = (llm, perplexity(llm, ids, window=512, stride=256), capacity)
            if mode != "int8":  # the coherence test still needs the int8 engine
                llm.engine = None
                cache[mode] = (None, *cache[mode][1:])
        return cache[mode]

    return get


def test_int8_kv_cache_fits_at_least_1_9x_the_tokens(results) -> None:
    """Issue #5: in the same memory the int8 cache holds >= 1.9x the tokens of the bf16 one.
    SmolLM2's head_dim 64 gives 64 int8 bytes + a 2-byte float16 scale per token per head
    (66 vs 128 bytes: 1.94x); float32 scales (68 bytes, 1.88x) would fail this."""
    if not _int8_kv_supported():
        pytest.skip("kv_cache_dtype='int8' is not wired into the torch attention backend yet")
    bf16, int8 = results("bf16")[2], results("int8-kv")[2]
    print(f"KV cache in {KV_CACHE_MEMORY >> 20} MiB: bf16 {bf16['tokens']} tokens "
          f"({bf16['bytes_per_token']:.0f} B/token), int8 {int8['tokens']} tokens "
          f"({int8['bytes_per_token']:.0f} B/token)")
    assert int8["scale_dtype"] == torch.float16
    assert bf16["allocated"] <= KV_CACHE_MEMORY and int8["allocated"] <= KV_CACHE_MEMORY
    assert bf16["bytes_per_token"] / int8["bytes_per_token"] >= 1.9
    assert int8["tokens"] / bf16["tokens"] >= 1.9


@pytest.mark.parametrize("mode", sorted(LIMITS))
def test_perplexity_increase_within_limit(results, mode: str) -> None:
    if mode == "int8-kv" and not _int8_kv_supported():
        pytest.skip("kv_cache_dtype='int8' is not wired into the torch attention backend yet")
    base = results("bf16")[1]
    quant = results(mode)[1]
    assert base["tokens"] == quant["tokens"] == NUM_TOKENS - 1
    assert 2.0 < base["perplexity"] < 30.0  # the model reads this text as English
    increase = quant["perplexity"] / base["perplexity"] - 1
    print(f"{mode}: perplexity {quant['perplexity']:.4f} vs bf16 {base['perplexity']:.4f} "
          f"({increase:+.2%})")
    assert increase <= LIMITS[mode]


def test_greedy_int8_output_is_english(results) -> None:
    from argosy_runtime import SamplingParams

    llm = results("int8")[0]
    out = llm.generate(["The Python standard library provides"],
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    text = out[0].outputs[0].text
    words = re.findall(r"[A-Za-z]+", text)
    vocabulary = set(re.findall(r"[a-z]+", eval_text().lower()))
    other_docs = "".join(inspect.getdoc(importlib.import_module(m)) or "" for m in (
        "os", "sys", "typing", "abc", "io", "re", "time", "math", "enum", "dataclasses"))
    vocabulary |= set(re.findall(r"[a-z]+", other_docs.lower()))
    known = [w for w in words if w.lower() in vocabulary]
    print("int8 greedy:", repr(text))
    assert len(words) >= 15, text
    assert len(known) >= 0.8 * len(words), text
    assert len(set(w.lower() for w in words)) >= 8, text  # not one word repeated
