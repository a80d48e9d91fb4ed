"""The model's norms, residual adds, rotary and SiLU through the Triton kernels
(`use_triton_ops`).

This is the CUDA engine's path; on the CPU the kernels run under the interpreter. The hidden
states must match the eager ops' over prefill chunks, mixed steps and decodes, with either
attention backend, with rope scaling, and through the graph runner's padded decode step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from argosy_runtime.attention import TorchAttentionBackend
from argosy_runtime.attention.triton_backend import TritonAttentionBackend
from argosy_runtime.cuda_graph_runner import CUDAGraphRunner
from engine_test_utils import build_step, forward, kv_caches, random_model, tiny_spec
from kernel_test_utils import DEVICE, generator

SPEC = tiny_spec()
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _backend(cls):
    s = SPEC
    return cls(s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.head_dim**-0.5)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=generator(seed)).tolist()


def _steps():
    a, b = _tokens(40, 1), _tokens(40, 2)
    blocks_a, blocks_b = [5, 2, 9], [7, 0, 11]
    return [
        [(a, blocks_a, 0, 20), (b, blocks_b, 0, 7)],  # two prompts (a chunk of a)
        [(a, blocks_a, 20, 1), (b, blocks_b, 7, 9)],  # a decodes; b's chunk after its prefix
        [(a, blocks_a, 21, 1), (b, blocks_b, 16, 1)],  # both decode
    ]


def _eager_and_triton(spec, seed: int, num_blocks: int):
    """Two float32 copies of one random model, eager ops and Triton ops, each with its cache:
    (eager, triton), ((kv, caches) of eager, (kv, caches) of triton)."""
    eager = random_model(spec, torch.float32, DEVICE, seed=seed)
    fused = random_model(spec, torch.float32, DEVICE, seed=seed)
    fused.use_triton_ops()
    return (eager, fused), [kv_caches(spec, num_blocks, torch.float32, DEVICE) for _ in "ef"]


def _compare(spec, backend_cls, tol: float = 1e-6):
    """Run the same steps with the eager ops and with the Triton ops: the largest difference
    within `tol` of the largest value."""
    (eager, fused), ((kv_e, caches_e), (kv_f, caches_f)) = _eager_and_triton(spec, 3, 12)
    backend = _backend(backend_cls)
    for seqs in _steps():
        step = build_step(seqs, DEVICE)
        want = forward(eager, backend, caches_e, step)
        got = forward(fused, backend, caches_f, step)
        _assert_within(got, want, tol)
    _assert_within(kv_f, kv_e, tol)  # keys rotated alike


def _assert_within(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= tol, f"max difference {err:.2e} of the largest value"


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend])
def test_triton_ops_match_eager_ops_in_float32(backend_cls):
    _compare(SPEC, backend_cls)


def test_triton_ops_match_eager_ops_with_llama3_rope_scaling():
    # Positions past original_max_position_embeddings, where the scaled frequencies differ.
    spec = dataclasses.replace(SPEC, rope_scaling=LLAMA3_SCALING)
    _compare(spec, TorchAttentionBackend)


def test_triton_ops_match_eager_ops_with_phi3_longrope_and_partial_rotary():
    # Phi-4-mini's rotary: longrope factors (short ones: max_positions <= original) and the
    # first half of each head rotated; the Triton table is rotary_dim wide.
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 2048,
               "attention_factor": 1.2, "short_factor": [1.0, 1.5, 2.0, 4.0],
               "long_factor": [8.0] * 4}
    spec = dataclasses.replace(SPEC, architecture="phi3", rope_scaling=scaling,
                               partial_rotary_factor=0.5)
    _compare(spec, TorchAttentionBackend, tol=2e-6)  # q.k scaled by 1.2^2: a few ulps more
    model = random_model(spec, torch.float32, DEVICE)
    model.use_triton_ops()
    assert model.rotary.cos_sin_cache.shape == (spec.max_position_embeddings, 8)


# Mixtral: every layer sparse, float32 routing weights; Qwen2-MoE: a dense layer 0, a
# sigmoid-gated shared expert, routing weights in the model dtype, top-k not renormalized.
MOE_SPECS = {
    "mixtral": dict(architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, norm_topk_prob=True, sparse_layers=(0, 1)),
    "qwen2_moe": dict(architecture="qwen2_moe", num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=24, shared_expert_intermediate_size=48,
                      sparse_layers=(1,)),
}


@pytest.mark.parametrize("arch", MOE_SPECS)
def test_triton_ops_run_moe_experts_fused_matching_eager(arch):
    spec = dataclasses.replace(SPEC, **MOE_SPECS[arch])
    _compare(spec, TorchAttentionBackend)
    model = random_model(spec, torch.float32, DEVICE)
    model.use_triton_ops()
    for i in spec.sparse_layers:
        moe = model.model.layers[i].mlp
        gate_up, down = moe.stacked_experts
        # Each expert's Linear now holds a view of the stack: no second copy of the weights.
        for e, expert in enumerate(moe.experts):
            assert expert.gate_up_proj.weight.data_ptr() == gate_up[e].data_ptr()
            assert expert.down_proj.weight.data_ptr() == down[e].data_ptr()
    model.use_triton_ops(False)
    assert all(model.model.layers[i].mlp.stacked_experts is None for i in spec.sparse_layers)


def test_triton_ops_in_bfloat16_as_close_to_float32_as_the_eager_ops():
    # Eager rounds to bf16 after every multiply, the kernels once (and the interpreter's
    # stores truncate): judge both by their distance from the float32 model.
    backend = _backend(TorchAttentionBackend)
    models = [random_model(SPEC, dtype, DEVICE, seed=3)
              for dtype in (torch.float32, torch.bfloat16, torch.bfloat16)]
    models[2].use_triton_ops()
    caches = [kv_caches(SPEC, 12, m.rotary.cos.dtype, DEVICE)[1] for m in models]
    for seqs in _steps():
        step = build_step(seqs, DEVICE)
        want, eager, fused = (forward(m, backend, c, step).float() for m, c in zip(models, caches))
        eager_err = ((eager - want).norm() / want.norm()).item()
        fused_err = ((fused - want).norm() / want.norm()).item()
        assert eager_err < 0.03 and fused_err <= 2 * eager_err, (eager_err, fused_err)


def test_cos_sin_cache_holds_the_eager_tables_frequencies():
    spec = dataclasses.replace(SPEC, rope_scaling={"rope_type": "linear", "factor": 4.0})
    model = random_model(spec, torch.float32, DEVICE)
    model.use_triton_ops()
    rotary, half = model.rotary, spec.head_dim // 2
    cache = rotary.cos_sin_cache
    assert cache.dtype == torch.float32 and cache.shape == (spec.max_position_embeddings,
                                                            spec.head_dim)
    torch.testing.assert_close(cache[:, :half], rotary.cos[:, :half], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, half:], rotary.signed_sin[:, half:], atol=0, rtol=0)
    # bf16 model: the eager tables are bf16, the Triton table stays float32.
    bf16 = random_model(spec, torch.bfloat16, DEVICE)
    bf16.use_triton_ops()
    assert bf16.rotary.cos.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.rotary.cos_sin_cache, cache, atol=0, rtol=0)


def test_triton_ops_run_each_layer_silu_as_one_kernel(monkeypatch):
    from argosy_runtime.models import llama

    calls = []
    real = llama.triton_silu_and_mul
    monkeypatch.setattr(llama, "triton_silu_and_mul", lambda x: calls.append(x.shape) or real(x))
    (eager, fused), ((_, caches_e), (_, caches_f)) = _eager_and_triton(SPEC, 5, 12)
    backend = _backend(TorchAttentionBackend)
    step = build_step(_steps()[0], DEVICE)
    _assert_within(forward(fused, backend, caches_f, step), forward(eager, backend, caches_e, step))
    assert calls == [(27, 2 * SPEC.intermediate_size)] * SPEC.num_hidden_layers


def test_switching_back_to_eager_ops_restores_them():
    model = random_model(SPEC, torch.float32, DEVICE)
    model.use_triton_ops()
    layer = model.model.layers[0]
    assert (model.ops, layer.self_attn.ops, layer.input_layernorm.ops, layer.mlp.ops) == \
        ("triton",) * 4
    model.use_triton_ops(False)
    assert (model.ops, layer.self_attn.ops, model.model.norm.ops, layer.mlp.ops) == \
        ("torch",) * 4


def test_graph_runner_padded_decode_with_triton_ops():
    """The CUDA engine's decode step: Triton ops and backend, 3 decodes padded to a bucket
    of 4 (eager here; captured on a GPU). Same hidden states as the unpadded eager-op step."""
    (eager, fused), ((kv_e, caches_e), (kv_f, caches_f)) = _eager_and_triton(SPEC, 4, 8)
    backend = _backend(TritonAttentionBackend)
    seqs = [(_tokens(40, 10 + i), blocks, 0, n)
            for i, (blocks, n) in enumerate([([1, 2], 17), ([3, 7], 16), ([4, 5, 6], 33)])]
    prefill = build_step(seqs, DEVICE)
    forward(eager, backend, caches_e, prefill)
    forward(fused, backend, caches_f, prefill)
    decode = build_step([(t, bl, n, 1) for t, bl, _, n in seqs], DEVICE)
    runner = CUDAGraphRunner(fused, caches_f, None, backend, max_blocks_per_seq=4,
                             device=DEVICE, max_batch_size=8, buckets=(1, 4),
                             enable_graphs=DEVICE.type == "cuda")
    runner.capture()
    want = forward(eager, backend, caches_e, decode)
    got = runner.run(*decode).clone()  # padded: replayed on a GPU, eager here
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_f, kv_e, atol=1e-5, rtol=1e-5)


def test_triton_ops_match_eager_ops_with_qwen3_qk_norms():
    # The per-head q/k RMSNorms through the Triton norm kernel (rows of head_dim). Two more
    # float32 roundings per layer than Llama: measured 1.1e-6 here, so 4e-6.
    spec = dataclasses.replace(SPEC, architecture="qwen3")
    assert spec.qk_norm
    _compare(spec, TorchAttentionBackend, tol=4e-6)


def test_triton_ops_match_eager_ops_for_gemma3():
    """Gemma 3's layer (four norms, float32 1 + w weights through the Triton norm kernel,
    gelu-tanh in torch) and its sliding layers' own rotary table (ctx.local_rotary's
    cos_sin_cache) beside the full layer's linearly scaled one, past the window."""
    spec = dataclasses.replace(
        SPEC, architecture="gemma3", hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24.0,
        local_rope_theta=100.0, layer_sliding_windows=(8, None),
        rope_scaling={"rope_type": "linear", "factor": 8.0})
    _compare(spec, TorchAttentionBackend)
