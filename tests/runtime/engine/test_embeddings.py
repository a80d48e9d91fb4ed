"""Embedding requests (PoolingParams) equal transformers' pooled hidden states (float32, CPU).

The reference is the base model's `last_hidden_state` (after the final norm), pooled the same
way (the last token's row, or sentence-transformers' mean, max, mean_sqrt_len_tokens and
weightedmean formulas over every row), then L2-normalized. Covered: a batch of mixed lengths,
every pooling, unnormalized vectors, embeddings beside generations in the same steps (whose
tokens must still equal transformers'), tiny prefill chunks (the poolings over every row run
across them), prefix-cache hits, preemption in the middle of an embedding's prompt, aborts,
and the errors a caller gets.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from argosy_runtime import LLM, LLMEngine, PoolingParams, SamplingParams
from engine_helpers import assert_no_leaks
from st_pooling_reference import ST_MODES, st_pool

# Every pooling a decoder takes (cls is for encoders): the last token, and
# sentence-transformers' poolings over every token.
POOLINGS = ["last", "mean", "max", "mean_sqrt_len_tokens", "weightedmean"]

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Hi",
    "Photosynthesis is the process by which plants turn light, water and carbon dioxide "
    "into sugar and oxygen; it happens in the chloroplasts of leaf cells.",
    "SELECT name FROM users WHERE",
]


def reference(hf, prompt_ids: list[int], pooling: str = "last",  # noqa: ANN001
              normalize: bool = True) -> torch.Tensor:
    """The pooled final hidden state: sentence-transformers' formula for `pooling`."""
    hidden = hf.hidden_states(prompt_ids)  # [n, hidden]
    vector = st_pool(hidden[None], torch.ones(1, len(hidden), dtype=torch.long),
                     ST_MODES[pooling][0])[0]
    return F.normalize(vector, dim=0) if normalize else vector


def assert_close(embedding: list[float] | None, expected: torch.Tensor) -> None:
    assert embedding is not None
    got = torch.tensor(embedding)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def embedded_llm() -> LLM:
    return LLM(model="smollm2-135m", dtype="float32")


@pytest.mark.parametrize("pooling", POOLINGS)
def test_batch_matches_transformers(embedded_llm: LLM, embedded_hf, pooling: str) -> None:  # noqa: ANN001
    outs = embedded_llm.embed(TEXTS, PoolingParams(pooling=pooling))
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)  # prompt order
    for o in outs:
        assert o.finished and o.outputs == []
        assert_close(o.embedding, reference(embedded_hf, o.prompt_token_ids, pooling))
        assert abs(torch.tensor(o.embedding).norm().item() - 1.0) < 1e-5
    # Different texts, different vectors (a pooler that returned one row for all would pass
    # the checks above only if the reference did the same).
    assert outs[0].embedding != outs[1].embedding
    assert_no_leaks(embedded_llm.engine)


def test_unnormalized_vectors_are_the_raw_hidden_state(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    for pooling in ("last", "mean"):
        [o] = embedded_llm.embed(TEXTS[0], PoolingParams(pooling=pooling, normalize=False))
        expected = reference(embedded_hf, o.prompt_token_ids, pooling, normalize=False)
        assert expected.norm() > 2  # really not normalized
        assert_close(o.embedding, expected)


def test_token_id_prompts_and_lone_tokens(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    for ids in ([1], [1, 504, 3458], list(range(100, 140))):
        [o] = embedded_llm.embed(ids, PoolingParams(pooling="mean"))
        assert o.prompt_token_ids == ids
        assert_close(o.embedding, reference(embedded_hf, ids, "mean"))


def test_embeddings_and_generations_share_steps(embedded_hf) -> None:  # noqa: ANN001
    # Small chunks make embedding prompts span several steps beside running decodes.
    engine = LLMEngine(model="smollm2-135m", dtype="float32", max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"gen{i}", text, greedy)
        engine.add_request(f"emb{i}", text, PoolingParams(pooling="mean" if i % 2 else "last"))
    mixed_steps = 0
    execute = engine.runner.execute

    def recording_execute(sched):  # noqa: ANN001, ANN202
        nonlocal mixed_steps
        kinds = {sr.request.request_id[:3] for sr in sched.scheduled}
        decoding = any(sr.request.request_id.startswith("gen") and not sr.request.is_prefill
                       for sr in sched.scheduled)
        mixed_steps += kinds == {"gen", "emb"} and decoding
        return execute(sched)

    engine.runner.execute = recording_execute
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert mixed_steps > 0  # an embedding's chunk ran beside decoding generations
    for i in range(len(TEXTS)):
        gen, emb = done[f"gen{i}"], done[f"emb{i}"]
        assert gen.outputs[0].token_ids == embedded_hf.greedy(gen.prompt_token_ids, 12)
        assert_close(emb.embedding, reference(embedded_hf, emb.prompt_token_ids,
                                              "mean" if i % 2 else "last"))
    assert engine.get_stats().generation_tokens == 12 * len(TEXTS)  # embeddings add none
    assert_no_leaks(engine)


def test_prefix_cache_hits(embedded_llm: LLM, embedded_hf) -> None:  # noqa: ANN001
    text = TEXTS[3] * 3  # several full blocks
    [gen] = embedded_llm.generate(text, SamplingParams(max_tokens=1, temperature=0.0))
    [last] = embedded_llm.embed(text)  # reuses the cached blocks: only the tail is computed
    assert last.num_cached_tokens > 0
    assert_close(last.embedding, reference(embedded_hf, gen.prompt_token_ids))
    for pooling in POOLINGS[1:]:  # they need every row
        [out] = embedded_llm.embed(text, PoolingParams(pooling=pooling))
        assert out.num_cached_tokens == 0
        assert_close(out.embedding, reference(embedded_hf, gen.prompt_token_ids, pooling))
    assert_no_leaks(embedded_llm.engine)


@pytest.mark.parametrize("pooling", ["last", "mean", "max", "weightedmean"])
def test_preempted_in_the_middle_of_its_prompt(random_llama_dir, random_llama_hf,  # noqa: ANN001
                                               pooling: str) -> None:
    # Per token: 2 layers x 2 (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes; 20 blocks
    # of 4 tokens. Three generations grow until the newest request, the embedding whose
    # 40-token prompt goes 6 tokens a step, must give its blocks back.
    engine = LLMEngine(model=str(random_llama_dir), dtype="float32", block_size=4,
                       max_num_batched_tokens=6, kv_cache_memory=20 * 4 * 512,
                       enable_prefix_caching=False)
    victims: list[str] = []
    preempt = engine.scheduler._preempt

    def recording_preempt(req):  # noqa: ANN001, ANN202
        victims.append(req.request_id)
        preempt(req)

    engine.scheduler._preempt = recording_preempt
    rng = random.Random(3)
    gens = [[rng.randrange(3, 49152) for _ in range(5)] for _ in range(3)]
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(gens):
        engine.add_request(f"gen{i}", p, greedy)
    engine.step()
    engine.add_request("emb", prompt, PoolingParams(pooling=pooling))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "emb" in victims
    assert_close(done["emb"].embedding, reference(random_llama_hf, prompt, pooling))
    for i, p in enumerate(gens):
        assert done[f"gen{i}"].outputs[0].token_ids == random_llama_hf.greedy(p, 20)
    assert_no_leaks(engine)


def test_qwen2_with_biases_matches_transformers(random_qwen2_dir, random_qwen2_hf) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_qwen2_dir), dtype="float32", block_size=4)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    for pooling in ("last", "mean"):
        for p, o in zip(prompts, llm.embed(prompts, PoolingParams(pooling=pooling))):
            assert_close(o.embedding, reference(random_qwen2_hf, p, pooling))


def test_abort_in_the_middle_of_a_prompt_frees_its_blocks() -> None:
    engine = LLMEngine(model="smollm2-135m", dtype="float32", max_num_batched_tokens=16)
    engine.add_request("emb", TEXTS[3] * 2, PoolingParams(pooling="mean"))
    engine.step()
    assert engine.kv_cache.req_to_blocks  # it holds blocks mid-prompt
    engine.abort_request("emb")
    assert_no_leaks(engine)


def test_bfloat16_is_close_to_float32(embedded_hf) -> None:  # noqa: ANN001
    # bf16 runs other kernels (C++ decode layers for prompts of <= 8 tokens, oneDNN GEMMs
    # and the varlen attention kernel for longer ones); its vectors stay close.
    llm = LLM(model="smollm2-135m", dtype="bfloat16")
    for o in llm.embed(["Hi there", TEXTS[3]]):
        expected = reference(embedded_hf, o.prompt_token_ids)
        assert F.cosine_similarity(torch.tensor(o.embedding), expected, dim=0) > 0.99


def test_bad_requests_raise_value_errors(embedded_llm: LLM) -> None:
    engine = embedded_llm.engine
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="min")
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize=1)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * (engine.max_model_len + 1), PoolingParams())
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty", "", PoolingParams())
    with pytest.raises(ValueError, match="lora_name"):
        engine.add_request("adapter", "hi", PoolingParams(), lora_name="nope")
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def headless_mistral_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from model_factory import make_random_model_dir

    return make_random_model_dir(tmp_path_factory.mktemp("models"), "mistral",
                                 num_hidden_layers=2, headless=True)


def test_headless_checkpoint_serves_embeddings_only(headless_mistral_dir) -> None:  # noqa: ANN001
    # A folder saved as transformers' MistralModel (no lm_head), as e5-mistral is published.
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(headless_mistral_dir), dtype=torch.float32).eval()
    llm = LLM(model=str(headless_mistral_dir), dtype="float32", block_size=4)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    for p, o in zip(prompts, llm.embed(prompts)):
        with torch.no_grad():
            hidden = hf(torch.tensor([p])).last_hidden_state[0].float()
        assert_close(o.embedding, F.normalize(hidden[-1], dim=0))
    with pytest.raises(ValueError, match="^model: .* serves embeddings only"):
        llm.generate(prompts[0], SamplingParams(max_tokens=2))
    assert_no_leaks(llm.engine)
    with pytest.raises(ValueError, match="^speculative: a headless"):
        LLM(model=str(headless_mistral_dir), dtype="float32", speculative="ngram")


def test_speculative_engine_never_drafts_for_an_embedding(embedded_hf) -> None:  # noqa: ANN001
    # A budget one token short of the prompt leaves exactly one prompt token for the second
    # step: the state speculation drafts from (and the prompt repeats itself, so n-gram
    # lookup finds drafts). An embedding request must get none: its last row would be a
    # draft's, not the prompt's.
    from argosy_runtime.model_loader import load_checkpoint

    prompt = load_checkpoint("smollm2-135m").tokenizer.encode(TEXTS[3] * 3)
    llm = LLM(model="smollm2-135m", dtype="float32", speculative="ngram",
              max_num_batched_tokens=len(prompt) - 1, enable_prefix_caching=False)
    for pooling in ("last", "mean"):
        [emb] = llm.embed(prompt, PoolingParams(pooling=pooling))
        assert_close(emb.embedding, reference(embedded_hf, prompt, pooling))
    assert llm.engine.get_stats().spec_decode_num_draft_tokens == 0
    assert_no_leaks(llm.engine)
