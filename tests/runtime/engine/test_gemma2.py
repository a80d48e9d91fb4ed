"""Gemma 2 models equal transformers' Gemma2ForCausalLM.

A tiny random Gemma 2 with every way it differs from Llama switched on: four norms per layer
scaling by 1 + weight, gelu-tanh MLP, embeddings times sqrt(hidden), head_dim 32 apart from
hidden / heads, attention scale query_pre_attn_scalar ** -0.5, every other layer sliding
(window 8, block_size 4: prompts run past it), and both soft caps small enough to change every
output: attention scores cap * tanh(s / cap) (attn_logit_softcapping 1.0; transformers' eager
attention, the only one it runs Gemma 2 with) and the final logits (5.0). Greedy tokens and
logprobs equal transformers' in float32 through chunked prefill (soft-capped PyTorch chunks)
and decodes (the C++ decode kernel where it builds), prefix-cache hits, preemption, n-gram
speculative decoding and the PyTorch-only attention paths; bfloat16 (the fused C++ decode and
varlen kernels, soft-capping, at head_dim 64) stays close to transformers' bfloat16; a
llama.cpp gemma2 GGUF file (norms stored plus 1, soft caps in metadata) equals its folder."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels import cpu_ops
from argosy_runtime import LLM
from argosy_runtime.model_loader.gguf_metadata import open_gguf
from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from engine_helpers import (
    FullForwardReference,
    assert_equals_reference,
    assert_no_leaks,
    check_window_prefix_hits_and_preemption,
    greedy,
    random_prompts,
)
from model_factory import make_random_model_dir, write_gguf_from_hf_dir

WINDOW = 8
ATTN_CAP, FINAL_CAP = 1.0, 5.0
GEMMA2_CONFIG = dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                     attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
MAX_POSITIONS = 256


def gemma2_dir(tmp_path, head_dim: int = 32, **extra):  # noqa: ANN001, ANN201
    """The test model (`extra`: more config fields); layer_types left to Gemma2Config's
    default (the even layers slide). init_std 0.15 as the Gemma 3 test's (with 0.5 the scaled
    embeddings outweigh the layers and greedy decoding repeats the previous token)."""
    return make_random_model_dir(
        tmp_path, "gemma2", name=f"gemma2-{head_dim}-{len(extra)}", num_hidden_layers=4,
        head_dim=head_dim, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        rms_norm_eps=1e-6, init_std=0.15, rope_theta=5000.0,
        extra_config={**GEMMA2_CONFIG, **extra})


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = gemma2_dir(tmp_path_factory.mktemp("models"))
    return folder, FullForwardReference.from_folder(folder)


def test_past_the_window_equals_transformers(gemma2) -> None:  # noqa: ANN001
    """Prompts shorter than, equal to and several times the window, in prefill chunks of 16
    (a chunk after cached tokens crosses the window), 20 generated tokens each; the attention
    soft cap changes transformers' own output (so equality means we cap)."""
    from transformers import AutoModelForCausalLM

    folder, ref = gemma2
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "gemma2" and spec.layer_sliding_windows == (8, None, 8, None)
    assert (spec.rope_theta, spec.local_rope_theta, spec.qk_norm) == (5000.0, None, False)
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert llm.engine.runner.backend.scale == 24 ** -0.5
    prompts = random_prompts(1, (1, WINDOW - 1, WINDOW, WINDOW + 1, 23, 40))
    outputs = llm.generate(prompts, greedy(20))
    assert_equals_reference(outputs, prompts, ref, 20)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 20  # not degenerate
    assert_no_leaks(llm.engine)
    uncapped = FullForwardReference(AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_logit_softcapping=None).eval())
    _, capped_lp = ref.greedy(prompts[4], 1)
    _, plain_lp = uncapped.greedy(prompts[4], 1)
    assert (capped_lp[0] - plain_lp[0]).abs().max() > 0.1


def test_prefix_hits_and_preemption(gemma2) -> None:  # noqa: ANN001
    """A shared prefix longer than the window (cache hits start a chunk mid-window) and a KV
    pool too small for all requests (preempted ones recompute)."""
    folder, ref = gemma2
    # Pages of two layers (one full table, one windowed; kv_cache/layout.py), per token:
    # 2 layers x (K, V) x 2 kv heads x 32 dims x 4 bytes = 1024 bytes.
    check_window_prefix_hits_and_preemption(folder, ref, 1024, 24, 18, (3, 9, 1, 12), 16)


def test_ngram_speculative_decoding_equals_transformers(gemma2) -> None:  # noqa: ANN001
    """Speculative verification (chunks of 1 + k tokens, soft-capped like prefill) changes
    nothing: prompts that repeat themselves so drafts get accepted."""
    folder, ref = gemma2
    llm = LLM(model=str(folder), dtype="float32", block_size=4, speculative="ngram")
    prompts = [p * 4 for p in random_prompts(10, (6, 5))]
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(llm.engine)


def test_pure_torch_ops_equal_transformers(gemma2) -> None:  # noqa: ANN001
    """Without the C++ attention kernels: decode rows through the gathered-block path, prompt
    chunks through masked attention, both soft-capped in PyTorch."""
    folder, ref = gemma2
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    llm.engine.model.use_fused_cpu_ops(False)
    llm.engine.runner.backend.fused_cpu_ops = False
    prompts = random_prompts(7, (3, 26))
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)


def test_bfloat16_stays_close_to_transformers_bfloat16(tmp_path) -> None:  # noqa: ANN001
    """bf16 at head_dim 64: the fused C++ decode attention and (with AVX512-BF16) varlen
    prompt kernel, both soft-capping; the layer itself on the module path (the C++ decode
    layer knows Llama's layer only). Compared at the first generated position with
    transformers in bfloat16 (this tiny model amplifies bf16 rounding), and every decode
    step's logprob against transformers' bfloat16 forward of the same tokens."""
    from transformers import AutoModelForCausalLM

    folder = gemma2_dir(tmp_path, head_dim=64)
    ref = FullForwardReference.from_folder(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, max_num_batched_tokens=16)
    model, backend = llm.engine.model, llm.engine.runner.backend
    assert model.cpu_decode is None and CpuDecodeLayers.build(model.model) is None
    if cpu_ops.available():
        assert backend.fused_cpu_ops and backend.bf16_prefill_kernel == cpu_ops.has_avx512_bf16()
    prompts = random_prompts(5, (6, 30, 3, 12, 17, 40))
    agree = 0
    outputs = llm.generate(prompts, greedy(4))
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():  # [4, vocab]: the positions that chose each generated token
            logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        want = torch.log_softmax(logits.float(), dim=-1)
        agree += tokens[0] in (int(want[0].argmax()), ref.greedy(prompt, 1)[0][0])
        for pos, token in enumerate(tokens):
            assert abs(out.outputs[0].logprobs[pos][token].logprob - want[pos, token].item()) < 0.1
    assert agree >= len(prompts) - 1
    assert_no_leaks(llm.engine)


def test_gguf_file_equals_transformers(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's gemma2 GGUF: norms stored as 1 + weight, post_attention_norm / ffn_norm /
    post_ffw_norm, the window and both soft caps in metadata. Its graph fixes what the file
    does not say (the even layers slide, query_pre_attn_scalar = head_dim), so the folder
    has those values."""
    folder = gemma2_dir(tmp_path, query_pre_attn_scalar=32)
    gguf = write_gguf_from_hf_dir(folder, tmp_path / "gemma2.gguf")
    assert "blk.0.post_ffw_norm.weight" in [t.name for t in open_gguf(gguf).tensors]
    ref = FullForwardReference.from_folder(folder)
    llm = LLM(model=str(gguf), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "gemma2" and spec.layer_sliding_windows == (8, None, 8, None)
    assert (spec.query_pre_attn_scalar, spec.attn_logit_softcapping,
            spec.final_logit_softcapping, spec.rope_theta) == (32.0, ATTN_CAP, FINAL_CAP, 5000.0)
    prompts = random_prompts(10, (3, 21))
    assert_equals_reference(llm.generate(prompts, greedy(8)), prompts, ref, 8)
    assert_no_leaks(llm.engine)
