"""A dropped `LLM` frees its engine (model, KV cache) at once, not when the garbage collector
next finds a reference cycle: nothing the engine owns points back at it strongly. (A test
suite or a notebook that builds engine after engine otherwise holds gigabytes of dead KV
caches: every CPU engine's is 2 GiB by default.)"""

from __future__ import annotations

import gc
import weakref

import pytest
from argosy_runtime import LLM, SamplingParams


@pytest.mark.parametrize("options", [
    {},
    {"speculative": "ngram"},  # SpeculativeDecoder and its proposer keep the engine
    {"max_loaded_loras": 2},  # the adapter registry's loader
], ids=["plain", "ngram", "lazy-lora"])
def test_dropped_llm_frees_its_engine_without_the_garbage_collector(options):
    gc.collect()
    gc.disable()
    try:
        llm = LLM(model="smollm2-135m", dtype="bfloat16", kv_cache_memory=16 << 20, **options)
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))
        engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv)
        del llm
        assert engine() is None and kv() is None
    finally:
        gc.enable()
