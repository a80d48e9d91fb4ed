"""Greedy outputs equal Hugging Face transformers token for token (float32, CPU).

Covers the embedded SmolLM2 (GGUF) and tiny random Llama / Qwen2 folders, single requests,
a batch of 16 mixed-length prompts, staggered arrivals, prefix-cache hits, tiny prefill
chunks and a KV pool small enough to force preemption. Logprobs match to 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch
from argosy_runtime import LLM, LLMEngine, SamplingParams
from engine_helpers import assert_no_leaks, run_requests

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Q: What is 2+2?\nA:",
    "import numpy as np\nx = np.arange(10)\n",
    "The three primary colors are",
    "In 1969, the first humans",
    "Here is a list of fruits: apple, banana,",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process by which plants",
    "A haiku about the sea:\n",
    "Dear hiring manager, I am writing to apply for the position of software engineer at your company because",
    "1, 2, 3, 4, 5,",
    "The most important thing to remember when cooking pasta is",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def embedded_llm() -> LLM:
    return LLM(model="smollm2-135m", dtype="float32")


def test_single_request_matches_transformers(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    [out] = embedded_llm.generate([TEXTS[0]], greedy(24))
    assert out.outputs[0].token_ids == embedded_hf.greedy(out.prompt_token_ids, 24)
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith(" Paris")
    assert_no_leaks(embedded_llm.engine)


def test_batch_of_16_mixed_length_prompts(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    outs = embedded_llm.generate(TEXTS, greedy(16))
    assert len({len(o.prompt_token_ids) for o in outs}) > 8  # genuinely mixed lengths
    for o in outs:
        assert o.outputs[0].token_ids == embedded_hf.greedy(o.prompt_token_ids, 16), o.prompt
    assert_no_leaks(embedded_llm.engine)


def test_logprobs_match_transformers(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    params = greedy(8, logprobs=5, prompt_logprobs=3)
    [out] = embedded_llm.generate([TEXTS[2]], params)
    ids = out.prompt_token_ids
    ref = embedded_hf.greedy_logprobs(ids, 8)
    for pos, token in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[pos]
        assert entry[token].rank == 1
        assert abs(entry[token].logprob - ref[pos][token].item()) < 1e-4
        top = torch.topk(ref[pos], 5)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
    prompt_ref = embedded_hf.prompt_logprobs(ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[ids[i]].logprob - prompt_ref[i - 1][ids[i]].item()) < 1e-4
        assert len(entry) >= 3
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[p][t].item() for p, t in enumerate(out.outputs[0].token_ids)), abs=1e-3
    )


def test_prompt_logprobs_are_complete_after_a_prefix_cache_hit(embedded_llm: LLM, embedded_hf
                                                                ) -> None:  # noqa: ANN001
    # A cached block has no logits: a request that scores its prompt must recompute what it
    # scores, even when an earlier identical prompt left every block in the cache.
    prompt = " ".join(TEXTS[8:])  # several blocks long
    ids = embedded_llm.generate([prompt], greedy(1))[0].prompt_token_ids  # caches its blocks
    assert len(ids) > 2 * embedded_llm.engine.cache_config.block_size
    hits_before = embedded_llm.engine.get_stats().prefix_cache_hits
    [out] = embedded_llm.generate([prompt], greedy(1, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == len(ids)
    prompt_ref = embedded_hf.prompt_logprobs(ids)
    for i in range(1, len(ids)):
        assert abs(out.prompt_logprobs[i][ids[i]].logprob - prompt_ref[i - 1][ids[i]].item()) < 1e-4
    assert embedded_llm.engine.get_stats().prefix_cache_hits == hits_before
    embedded_llm.generate([prompt], greedy(1))  # a plain request still reuses the blocks
    assert embedded_llm.engine.get_stats().prefix_cache_hits > hits_before
    assert_no_leaks(embedded_llm.engine)


def test_chunked_prefill_prefix_hits_and_preemption_together(embedded_hf) -> None:  # noqa: ANN001
    # 8-token chunks, a pool of 14 blocks of 16 tokens: 8 requests of ~30-60 tokens cannot all
    # fit, so the newest are preempted and recomputed; shared prefixes hit the cache.
    engine = LLMEngine(model="smollm2-135m", dtype="float32", max_num_batched_tokens=8,
                       kv_cache_memory=14 * engine_block_bytes(), block_size=16)
    shared = ("You are a helpful assistant. Answer briefly and precisely, in plain English, "
              "without lists or headings, and say so when you do not know. Question: ")
    prompts = [shared + q for q in ("What is the sun?", "Why is the sky blue?",
                                    "What is rain?", "How do birds fly?")] + TEXTS[:4]
    outputs = run_requests(engine, [(p, greedy(24)) for p in prompts])
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    for prompt, o in zip(prompts, outputs, strict=True):
        assert o.outputs[0].token_ids == embedded_hf.greedy(o.prompt_token_ids, 24), prompt
    assert_no_leaks(engine)


def engine_block_bytes() -> int:
    # SmolLM2-135M: 30 layers x (K, V) x 3 kv heads x 64 dims x 4 bytes x 16 tokens
    return 30 * 2 * 3 * 64 * 4 * 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_models_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"random_{arch}_dir")
    ref = request.getfixturevalue(f"random_{arch}_hf")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    llm = LLM(model=str(path), dtype="float32", block_size=4)
    outs = llm.generate(prompts, greedy(20))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ref.greedy(p, 20)
    assert_no_leaks(llm.engine)


def test_staggered_arrivals_tiny_chunks_and_preemption_random_llama(
    random_llama_dir, random_llama_hf  # noqa: ANN001
) -> None:
    # Per token: 2 layers x 2 (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes.
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_num_batched_tokens=6, kv_cache_memory=24 * 4 * 512)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 49152) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))]
               for _ in range(10)]
    done = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, greedy(30))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].outputs[0].token_ids == random_llama_hf.greedy(p, 30)
    assert_no_leaks(engine)
