"""Qwen3 (per-head q/k RMSNorm before the rotary, head_dim apart from hidden / heads) equals
transformers' Qwen3ForCausalLM: greedy tokens and logprobs in float32 from an HF folder and
from a GGUF file, bfloat16 close, and a headless Qwen3Model (how Qwen3-Embedding is
published) giving transformers' pooled hidden states."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from argosy_runtime import LLM, SamplingParams
from engine_helpers import assert_no_leaks
from model_factory import QWEN3_TEST_SHAPE, make_random_model_dir, write_gguf_from_hf_dir


def prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def test_greedy_tokens_and_logprobs_equal_transformers(random_qwen3_dir, random_qwen3_hf) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_qwen3_dir), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.spec.architecture == "qwen3" and llm.engine.spec.qk_norm
    for p, o in zip(prompts(1), llm.generate(prompts(1), greedy(16))):
        seq = o.outputs[0]
        assert seq.token_ids == random_qwen3_hf.greedy(p, 16)
        expected = random_qwen3_hf.greedy_logprobs(p, 16)
        for pos, token in enumerate(seq.token_ids):
            assert abs(seq.logprobs[pos][token].logprob - expected[pos][token].item()) < 1e-4
    assert_no_leaks(llm.engine)


def test_gguf_file_equals_transformers(random_qwen3_dir, random_qwen3_hf, tmp_path) -> None:  # noqa: ANN001
    gguf = write_gguf_from_hf_dir(random_qwen3_dir, tmp_path / "qwen3.gguf")
    llm = LLM(model=str(gguf), dtype="float32", block_size=4)
    assert llm.engine.spec.architecture == "qwen3" and llm.engine.spec.head_dim == 32
    for p, o in zip(prompts(2), llm.generate(prompts(2), greedy(12))):
        assert o.outputs[0].token_ids == random_qwen3_hf.greedy(p, 12)


def test_bfloat16_with_the_fused_cpu_ops_stays_close(random_qwen3_dir, random_qwen3_hf) -> None:  # noqa: ANN001
    # bf16 takes the fused C++ norms and rotary (q/k norms included) on the module path.
    llm = LLM(model=str(random_qwen3_dir), dtype="bfloat16", block_size=4)
    model = llm.engine.model
    assert model.model.layers[0].self_attn.q_norm.ops == model.ops
    agree = total = 0
    for p, o in zip(prompts(3), llm.generate(prompts(3), greedy(1))):
        expected = random_qwen3_hf.greedy_logprobs(p, 1)[0]
        got = o.outputs[0]
        total += 1
        agree += got.token_ids[0] == int(expected.argmax())
        assert abs(got.logprobs[0][got.token_ids[0]].logprob
                   - expected[got.token_ids[0]].item()) < 0.15
    assert agree >= total - 1  # a bf16 near-tie may flip one


def test_headless_qwen3_embeddings_equal_transformers(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModel

    folder = make_random_model_dir(tmp_path, "qwen3", headless=True, **QWEN3_TEST_SHAPE)
    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    for p, o in zip(prompts(4), llm.embed(prompts(4))):
        with torch.no_grad():
            last = hf(torch.tensor([p])).last_hidden_state[0, -1].float()
        torch.testing.assert_close(torch.tensor(o.embedding), F.normalize(last, dim=0),
                                   atol=1e-4, rtol=1e-4)
