"""Prefix caching changes no output: random workloads, cache on in a tight pool vs off.

Each seed draws requests sharing a few prefixes (some on another tenant's `cache_salt`, a
few priorities, staggered arrivals, some aborted midway) and an engine with small blocks, a
token budget small enough to chunk prompts and a KV pool small enough to preempt. The
requests run on that engine with prefix caching on, then (without aborts) on a roomy engine
with prefix caching off: a finished request's tokens must be equal (logprobs within float32
batch noise), an aborted one's a prefix of them. The cache must have been hit and someone
preempted, and afterwards no block may be held (`kv_cache_usage` 0: cached blocks are free).

Models: the embedded SmolLM2-135M (text prompts) and a tiny random Qwen2 whose second layer
slides (the hybrid layout: a full and a windowed block table on one pool).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.kv_cache.sliding_window import max_blocks_held

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime (as conftest)

from engine_helpers import assert_no_leaks, run_with_arrivals  # noqa: E402
from model_factory import make_random_model_dir  # noqa: E402

SHARED = ["You are a helpful assistant. Answer in one short sentence. Question: ",
          "Translate the following English sentence into French, keeping its tone: "]
TAILS = ["What is the sun?", "Why is the sky blue?", "How do birds fly?", "I like green tea.",
         "Where is Paris?", "The cat sleeps."]
WINDOW = 6  # the random Qwen2's second layer
LOGPROB_TOL = 1e-3  # float32: a row's GEMMs of another batch shape round differently


def smollm_prompt(rng: random.Random, tokenize) -> list[int]:  # noqa: ANN001
    return tokenize(rng.choice(SHARED) + rng.choice(TAILS))


def random_prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    base = rng.choice(bases)
    return base[: rng.randint(len(base) // 2, len(base))] + [rng.randrange(3, 49152)
                                                             for _ in range(rng.randint(1, 6))]


def draw_requests(rng: random.Random, prompt) -> list[dict]:  # noqa: ANN001
    reqs = []
    for i in range(rng.randint(6, 8)):
        params = SamplingParams(max_tokens=rng.randint(2, 6), temperature=0.0, ignore_eos=True,
                                logprobs=0, cache_salt=rng.choice([None, None, "tenant-b"]))
        reqs.append(dict(prompt=prompt(), params=params, priority=rng.choice([0, 0, 1]),
                         lora=None, arrive=rng.randint(0, 8) if i else 0,
                         abort=rng.choice([None, None, None, rng.randint(2, 12)])))
    return reqs


def longest(reqs: list[dict]) -> int:
    return max(len(r["prompt"]) + r["params"].max_tokens for r in reqs)


def check_against_uncached(tight: LLMEngine, roomy: LLMEngine, reqs: list[dict]) -> None:
    """`reqs` on `tight` (prefix caching on) equal the same without aborts on `roomy`
    (prefix caching off); `tight` hit the cache, preempted, and holds no block after."""
    outputs = run_with_arrivals(tight, reqs, max_steps=400)
    stats = tight.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
    assert_no_leaks(tight)
    ref = run_with_arrivals(roomy, [dict(r, abort=None) for r in reqs], max_steps=400)
    for i, r in enumerate(reqs):
        rid = f"r{i}"
        want = ref[rid].outputs[0]
        if rid not in outputs:  # aborted before it produced anything
            assert r["abort"] is not None
            continue
        got = outputs[rid].outputs[0]
        n = len(got.token_ids)
        assert got.token_ids == want.token_ids[:n], rid
        if r["abort"] is None:
            assert n == len(want.token_ids), rid
        for pos, token in enumerate(got.token_ids):
            assert abs(got.logprobs[pos][token].logprob
                       - want.logprobs[pos][token].logprob) < LOGPROB_TOL, (rid, pos)


@pytest.mark.parametrize("seed", [0, 1])
def test_smollm2_outputs_do_not_depend_on_the_prefix_cache(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    block_bytes = 30 * 2 * 3 * 64 * 4 * block_size  # layers x (K, V) x kv heads x dims x fp32
    roomy = LLMEngine(model="smollm2-135m", dtype="float32", block_size=block_size,
                      max_num_batched_tokens=256, enable_prefix_caching=False,
                      kv_cache_memory=256 * block_bytes)
    reqs = draw_requests(rng, lambda: smollm_prompt(rng, roomy.tokenizer.encode))
    # The longest request and a few blocks more: most others must wait or be preempted.
    num_blocks = -(-longest(reqs) // block_size) + 3
    tight = LLMEngine(model="smollm2-135m", dtype="float32", block_size=block_size,
                      max_num_batched_tokens=8, max_num_seqs=4,
                      kv_cache_memory=num_blocks * block_bytes)
    check_against_uncached(tight, roomy, reqs)


@pytest.fixture(scope="module")
def hybrid_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # layer 0 full, layer 1 windowed: a full and a windowed block table on one pool
    return make_random_model_dir(tmp_path_factory.mktemp("models"), "qwen2",
                                 max_position_embeddings=128,
                                 extra_config={"sliding_window": WINDOW,
                                               "use_sliding_window": True,
                                               "max_window_layers": 1})


# Seeds whose workloads both hit the cache and preempt (3 and 7 do not: a windowed hit needs
# blocks that the pool evicts first, those released behind the window early).
@pytest.mark.parametrize("seed", [0, 1, 2, 4, 5, 6])
def test_hybrid_outputs_do_not_depend_on_the_prefix_cache(seed: int,
                                                          hybrid_qwen2_dir: Path) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    budget = rng.choice([3, 5, 8])
    bases = [[rng.randrange(3, 49152) for _ in range(rng.randint(8, 20))] for _ in range(2)]
    reqs = draw_requests(rng, lambda: random_prompt(rng, bases))
    page_bytes = 2 * 2 * 16 * 4 * block_size  # one layer: (K, V) x 2 KV heads x 16 dims x fp32
    # The longest request's pages in both tables, and a few more.
    num_pages = (-(-longest(reqs) // block_size) + 3
                 + max_blocks_held(longest(reqs), budget, WINDOW, block_size))

    def engine(num_pages: int, budget: int, caching: bool) -> LLMEngine:
        return LLMEngine(model=str(hybrid_qwen2_dir), dtype="float32", block_size=block_size,
                         max_num_batched_tokens=budget, max_num_seqs=4,
                         enable_prefix_caching=caching, kv_cache_memory=num_pages * page_bytes)

    check_against_uncached(engine(num_pages, budget, True), engine(1024, 256, False), reqs)
