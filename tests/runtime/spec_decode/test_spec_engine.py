"""Speculative decoding inside the engine: greedy outputs equal plain decoding, no KV leaks."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from engine_helpers import assert_no_leaks  # noqa: E402
from engine_helpers import run_to_completion as run  # noqa: E402
from model_factory import make_random_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("spec"), "llama", num_hidden_layers=2)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookup finds matches and some drafts pass."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 8))]
        out.append(phrase * rng.randint(2, 5) + [rng.randrange(3, 49152)])
    return out




@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[int]]:
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4)
    return run(engine, repetitive_prompts(8, 0), SamplingParams(max_tokens=24, temperature=0,
                                                                ignore_eos=True))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
def test_greedy_ngram_speculation_is_exact(k: int, model_dir: Path, reference) -> None:  # noqa: ANN001
    # A pool small enough to preempt, a long shared prompt prefix for cache hits, small chunks.
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       kv_cache_memory=40 * 4 * 512, max_num_batched_tokens=16,
                       speculative={"method": "ngram", "num_speculative_tokens": k,
                                    "adaptive": False})
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = run(engine, repetitive_prompts(8, 0), params)
    assert out == reference
    stats = engine.get_stats()
    # Random weights rarely repeat the prompt, so this mostly exercises rejection and rollback;
    # the embedded-model test below exercises long accepted runs.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("method,k", [("ngram", 3), ("ngram", 8), ("draft", 4)])
def test_short_chunks_as_decode_rows_are_exact(method: str, k: int, model_dir: Path,
                                               reference) -> None:  # noqa: ANN001
    # Where the C++ decode layers run, chunks of up to 8 tokens (verification steps, a draft
    # catching up, short prompts) are decode rows, each attending to its own prefix. The
    # float32 module path reads the same metadata: every row must see exactly its prefix
    # (k = 8 makes 9-token chunks, which stay prefill chunks next to the rows).
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       kv_cache_memory=40 * 4 * 512, max_num_batched_tokens=16,
                       speculative={"method": method, "num_speculative_tokens": k,
                                    "adaptive": False, **({"draft_layers": 1} if method == "draft" else {})})
    engine.model.decode_rows_up_to = 8
    rows_per_step = []
    backend = engine.runner.backend
    original = backend._decode_attention
    backend._decode_attention = lambda q, *a: rows_per_step.append(q.shape[0]) or original(q, *a)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert run(engine, repetitive_prompts(8, 0), params) == reference
    assert max(rows_per_step) > 8, "steps with several rows per sequence ran"
    assert_no_leaks(engine)


def test_speculation_pauses_while_the_batch_is_large(model_dir: Path, reference) -> None:  # noqa: ANN001
    # disable_by_batch_size=2: no drafts while more than 2 requests run; once only two are
    # left they speculate, and outputs stay exact either way.
    def engine() -> LLMEngine:
        return LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                         speculative={"method": "draft", "draft_layers": 1, "adaptive": False,
                                      "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    busy = engine()  # 8 equal requests run together to the end
    assert run(busy, repetitive_prompts(8, 0), greedy) == reference
    assert busy.get_stats().spec_decode_num_draft_tokens == 0
    shrinking = engine()  # 6 of them aborted at step 4
    done = run(shrinking, repetitive_prompts(8, 0), greedy,
               abort_after={f"r{i}": 4 for i in range(2, 8)})
    assert done == {rid: reference[rid] for rid in ("r0", "r1")}
    assert shrinking.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(shrinking)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        LLMEngine(model=str(model_dir), dtype="float32",
                  speculative={"method": "ngram", "disable_by_batch_size": 0})


def test_aborts_during_speculation_leave_no_blocks_behind(model_dir: Path) -> None:
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       speculative={"method": "ngram", "num_speculative_tokens": 4})
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    done = run(engine, repetitive_prompts(6, 1), params, abort_after={"r1": 2, "r4": 5})
    assert "r1" not in done and "r4" not in done and len(done) == 4
    assert all(len(t) == 40 for t in done.values())
    assert engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)


def test_seeded_sampling_with_speculation_is_reproducible(model_dir: Path) -> None:
    def sample() -> dict[str, list[int]]:
        engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                           speculative={"method": "ngram", "num_speculative_tokens": 3})
        return run(engine, repetitive_prompts(3, 2),
                   SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11,
                                  ignore_eos=True))

    assert sample() == sample()


PASSAGE = (
    "The Apollo program was the third United States human spaceflight program carried out by "
    "NASA, which succeeded in preparing and landing the first humans on the Moon from 1968 to "
    "1972. It was first conceived during Dwight D. Eisenhower's administration as a three-person "
    "spacecraft to follow the one-person Project Mercury."
)


def test_embedded_model_copy_task_accepts_drafts_and_matches_plain_decoding() -> None:
    from argosy_runtime import LLM

    messages = [[{"role": "user", "content": f"Copy this text exactly:\n\n{PASSAGE}"}],
                [{"role": "user", "content": f"Repeat the first sentence of:\n\n{PASSAGE}"}]]
    params = SamplingParams(max_tokens=48, temperature=0)
    plain = LLM(model="smollm2-135m", dtype="float32", max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in plain.chat(messages, params)]
    del plain
    spec = LLM(model="smollm2-135m", dtype="float32", max_num_batched_tokens=64,
               speculative={"method": "ngram", "num_speculative_tokens": 5})
    got = [o.outputs[0].token_ids for o in spec.chat(messages, params)]
    assert got == expected
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.5 * stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(spec.engine)


def test_draft_proposer_hashes_lora_blocks_with_the_adapters_salt(tmp_path: Path) -> None:
    # A 2-token prompt and block_size 4: accepted drafts complete the first block, which the
    # draft proposer's slot allocation hashed before the scheduler did. It must carry the
    # adapter's salt, or a base-model request with the same tokens would reuse LoRA K/V.
    from argosy_runtime.kv_cache.kv_cache_manager import hash_block_tokens
    from model_factory import make_peft_adapter

    model = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)
    # A near-zero adapter: the base-model self-draft agrees with it, so drafts are accepted.
    lora = make_peft_adapter(model, tmp_path / "a", 1, r=4, lora_alpha=0.01,
                             target_modules=["q_proj", "v_proj"])
    engine = LLMEngine(model=str(model), dtype="float32", block_size=4,
                       lora_modules={"a": str(lora)},
                       speculative={"method": "draft", "draft_layers": 2, "adaptive": False,
                                    "num_speculative_tokens": 4})
    prompt = [5, 6]
    engine.add_request("x", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True), lora_name="a")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    first_block = (prompt + tokens)[:4]
    assert engine.kv_cache.pool.get_cached_block(hash_block_tokens(None, first_block)) is None
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Greedy reply to a prompt ending in 100: 200 300 ... 700, then EOS (model_factory)."""
    from model_factory import make_scripted_model_dir

    return make_scripted_model_dir(tmp_path_factory.mktemp("scripted"), 100,
                                   [200, 300, 400, 500, 600, 700])


@pytest.mark.parametrize("temperature", [2.0, 6.0])
def test_seeded_sampling_with_ngram_speculation_draws_the_plain_tokens(
        temperature: float, scripted_dir: Path) -> None:
    # The prompt repeats the model's script, so n-gram drafts follow it; at these temperatures
    # the target often samples something else: accepted runs and rejections. A seeded request
    # must get the tokens it gets without speculation (docs/engine.md, batch-invariant mode).
    prompt = [5] + [100, 200, 300, 400, 500, 600, 700] * 2 + [100]
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, n=2,
                            ignore_eos=True)

    def sample(speculative: dict | None) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(model=str(scripted_dir), dtype="float32", block_size=4,
                           speculative=speculative)
        engine.add_request("r", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = [c.token_ids for c in out.outputs]
        return tokens, engine

    plain, _ = sample(None)
    spec, engine = sample({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    stats = engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert spec == plain
    assert_no_leaks(engine)


def test_a_draft_proposes_under_the_requests_masks_and_penalties(model_dir: Path) -> None:
    """The draft chooses from logits processed as the target's verification processes them
    (allowed_token_ids, logit_bias, the repetition penalty, after the drafts before each
    position), so the target's whole copy as its draft has every draft accepted. From its raw
    logits it proposed tokens the masks forbid, and nearly none were accepted."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            allowed_token_ids=list(range(100, 400)), logit_bias={150: 3.0},
                            repetition_penalty=1.5)
    prompts = repetitive_prompts(3, 1)
    plain = run(LLMEngine(model=str(model_dir), dtype="float32", block_size=4), prompts, params)
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4, speculative={
        "method": "draft", "draft_layers": 2, "num_speculative_tokens": 3, "adaptive": False})
    assert run(engine, prompts, params) == plain
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_no_leaks(engine)
