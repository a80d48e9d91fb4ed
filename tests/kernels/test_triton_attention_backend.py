"""TritonAttentionBackend and CUDAGraphRunner driven through the runtime's Llama model.

On the CPU the Triton kernels run under the interpreter: the model's hidden states with the
Triton backend must match the torch backend over prefill chunks (with a cached prefix), mixed
steps and decodes. CUDA-graph capture itself needs a GPU; the runner's padding logic does not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from argosy_runtime.attention import TorchAttentionBackend
from argosy_runtime.attention.triton_backend import TritonAttentionBackend
from argosy_runtime.cuda_graph_runner import CUDAGraphRunner
from engine_test_utils import build_step, forward, kv_caches, random_model, tiny_spec
from kernel_test_utils import DEVICE, HAS_CUDA, generator

SPEC = tiny_spec()


def _backends():
    s = SPEC
    args = (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.head_dim**-0.5)
    return TorchAttentionBackend(*args), TritonAttentionBackend(*args)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=generator(seed)).tolist()


def test_triton_backend_matches_torch_backend_through_the_model():
    model = random_model(SPEC, torch.float32, DEVICE)
    torch_backend, triton_backend = _backends()
    kv_t, caches_t = kv_caches(SPEC, 12, torch.float32, DEVICE)
    kv_k, caches_k = kv_caches(SPEC, 12, torch.float32, DEVICE)
    a, b = _tokens(40, 1), _tokens(40, 2)
    blocks_a, blocks_b = [5, 2, 9], [7, 0, 11]
    steps = [
        [(a, blocks_a, 0, 20), (b, blocks_b, 0, 7)],  # two prompts (chunk of a)
        [(a, blocks_a, 20, 1), (b, blocks_b, 7, 9)],  # a decodes; b's chunk after a prefix
        [(a, blocks_a, 21, 1), (b, blocks_b, 16, 1)],  # both decode; b at a block boundary
        [(a, blocks_a, 22, 1), (b, blocks_b, 17, 1)],
    ]
    for seqs in steps:
        step = build_step(seqs, DEVICE)
        want = forward(model, torch_backend, caches_t, step)
        got = forward(model, triton_backend, caches_k, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_k, kv_t)


@pytest.mark.parametrize("windows", [(13, None), (7, 16)], ids=["mixed", "all"])
def test_sliding_windows_through_the_model(windows):
    """Each layer passes its window (models.llama.Attention) to the backend: the Triton
    kernels equal the torch backend's windowed paths over chunks, a cached prefix and
    decodes past the window, and the window changes the result."""
    spec = dataclasses.replace(SPEC, layer_sliding_windows=windows)
    model = random_model(spec, torch.float32, DEVICE)
    full_model = random_model(SPEC, torch.float32, DEVICE)
    torch_backend, triton_backend = _backends()
    _, caches_t = kv_caches(spec, 12, torch.float32, DEVICE)
    _, caches_k = kv_caches(spec, 12, torch.float32, DEVICE)
    _, caches_f = kv_caches(spec, 12, torch.float32, DEVICE)
    a, b = _tokens(40, 4), _tokens(40, 5)
    blocks_a, blocks_b = [5, 2, 9], [7, 0, 11]
    steps = [
        [(a, blocks_a, 0, 20), (b, blocks_b, 0, 7)],
        [(a, blocks_a, 20, 1), (b, blocks_b, 7, 14)],  # b's chunk after a prefix, past 13
        [(a, blocks_a, 21, 1), (b, blocks_b, 21, 1)],
        [(a, blocks_a, 22, 1), (b, blocks_b, 22, 1)],
    ]
    for seqs in steps:
        step = build_step(seqs, DEVICE)
        want = forward(model, torch_backend, caches_t, step)
        got = forward(model, triton_backend, caches_k, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        full = forward(full_model, torch_backend, caches_f, step)
    assert (full - want).abs().max() > 1e-2  # the last step is past every window


def test_gemma2_softcap_through_the_model():
    """A Gemma 2 spec (attention logit soft-capping on every layer, windowed and full layers,
    query_pre_attn_scalar) passes `softcap` to the backend: the Triton kernels equal the torch
    backend (C++ decode rows where they build, the PyTorch soft-capped chunks) over chunks, a
    cached prefix and decodes past the window, and the cap changes the result."""
    spec = dataclasses.replace(SPEC, architecture="gemma2", layer_sliding_windows=(13, None),
                               hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8.0,
                               attn_logit_softcapping=1.0)
    uncapped = dataclasses.replace(spec, attn_logit_softcapping=None)
    model, plain = random_model(spec, torch.float32, DEVICE), random_model(uncapped, torch.float32, DEVICE)
    args = (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.attention_scale)
    torch_backend, triton_backend = TorchAttentionBackend(*args), TritonAttentionBackend(*args)
    _, caches_t = kv_caches(spec, 12, torch.float32, DEVICE)
    _, caches_k = kv_caches(spec, 12, torch.float32, DEVICE)
    _, caches_p = kv_caches(spec, 12, torch.float32, DEVICE)
    a, b = _tokens(40, 6), _tokens(40, 7)
    blocks_a, blocks_b = [5, 2, 9], [7, 0, 11]
    steps = [
        [(a, blocks_a, 0, 20), (b, blocks_b, 0, 7)],
        [(a, blocks_a, 20, 1), (b, blocks_b, 7, 14)],
        [(a, blocks_a, 21, 1), (b, blocks_b, 21, 1)],
    ]
    for seqs in steps:
        step = build_step(seqs, DEVICE)
        want = forward(model, torch_backend, caches_t, step)
        got = forward(model, triton_backend, caches_k, step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        other = forward(plain, torch_backend, caches_p, step)
    assert (other - want).abs().max() > 1e-2


def test_triton_backend_int8_cache_close_to_full_precision():
    model = random_model(SPEC, torch.float32, DEVICE)
    torch_backend, triton_backend = _backends()
    _, caches_t = kv_caches(SPEC, 8, torch.float32, DEVICE)
    _, caches_q = kv_caches(SPEC, 8, torch.int8, DEVICE)
    scales = [(torch.ones(8, 16, SPEC.num_key_value_heads, dtype=torch.float16, device=DEVICE),
               torch.ones(8, 16, SPEC.num_key_value_heads, dtype=torch.float16, device=DEVICE))
              for _ in range(SPEC.num_hidden_layers)]
    a = _tokens(30, 3)
    for seqs in ([(a, [3, 1], 0, 18)], [(a, [3, 1], 18, 1)]):
        step = build_step(seqs, DEVICE)
        want = forward(model, torch_backend, caches_t, step)
        got = forward(model, triton_backend, caches_q, step, scales)
        err = (got - want).abs().max() / want.abs().max()
        assert err < 0.03, f"int8 KV relative error {err:.4f}"


def _graph_runner(model, backend, caches, enable_graphs):
    return CUDAGraphRunner(model, caches, None, backend, max_blocks_per_seq=4, device=DEVICE,
                           max_batch_size=8, buckets=(1, 4), enable_graphs=enable_graphs)


def _decode_scenario(model, backend, caches):
    """Prefill three sequences eagerly, return the next (decode) step and a mixed step."""
    seqs = [(_tokens(40, 10 + i), blocks, 0, n)
            for i, (blocks, n) in enumerate([([1, 2], 17), ([3, 7], 16), ([4, 5, 6], 33)])]
    forward(model, backend, caches, build_step(seqs, DEVICE))
    decode = build_step([(t, bl, n, 1) for t, bl, _, n in seqs], DEVICE)
    mixed = build_step([(seqs[0][0], seqs[0][1], 17, 1), (seqs[1][0], seqs[1][1], 16, 3)], DEVICE)
    return decode, mixed


def test_graph_runner_padding_matches_eager_on_cpu_or_gpu():
    """3 decodes padded to the bucket of 4 (eager, no capture): same hidden states and
    the same cache as the unpadded eager step; the pad row writes nothing."""
    model = random_model(SPEC, torch.float32, DEVICE, seed=1)
    _, triton_backend = _backends()
    kv_a, caches_a = kv_caches(SPEC, 8, torch.float32, DEVICE)
    kv_b, caches_b = kv_caches(SPEC, 8, torch.float32, DEVICE)
    decode, mixed = _decode_scenario(model, triton_backend, caches_a)
    _decode_scenario(model, triton_backend, caches_b)
    runner = _graph_runner(model, triton_backend, caches_b, enable_graphs=False)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(9) is None
    assert runner.can_run(3, decode[2]) and not runner.can_run(4, mixed[2])
    want = forward(model, triton_backend, caches_a, decode)
    got = runner.run(*decode)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_b, kv_a)  # slot -1 of the pad row wrote nothing
    with pytest.raises(ValueError):
        runner.run(*mixed)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graph capture needs a CUDA GPU")
def test_graph_replay_matches_eager_on_gpu():
    model = random_model(SPEC, torch.float32, DEVICE, seed=2)
    _, triton_backend = _backends()
    kv_a, caches_a = kv_caches(SPEC, 8, torch.float32, DEVICE)
    kv_b, caches_b = kv_caches(SPEC, 8, torch.float32, DEVICE)
    decode, mixed = _decode_scenario(model, triton_backend, caches_a)
    _decode_scenario(model, triton_backend, caches_b)
    runner = _graph_runner(model, triton_backend, caches_b, enable_graphs=True)
    runner.capture()
    want = forward(model, triton_backend, caches_a, decode)
    got = runner.forward(*decode).clone()
    assert runner.num_replays == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_b, kv_a)
    runner.forward(*mixed)  # not a pure decode: eager fallback
    assert runner.num_eager == 1 and runner.num_replays == 1


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA, reason="the engine's Triton path needs a CUDA GPU")
def test_engine_greedy_tokens_same_with_triton_attention_on_gpu():
    """The embedded model in float32 on CUDA: greedy tokens with the torch path (attention
    backend, norms, rotary) and with the Triton one, the engine's default there, are
    identical."""
    from argosy_runtime import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model="smollm2-135m", dtype="float32", device="cuda", enforce_eager=True)
    runner, model = llm.engine.runner, llm.engine.model
    assert isinstance(runner.backend, TritonAttentionBackend) and model.ops == "triton"
    triton_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    old = runner.backend
    runner.backend = TorchAttentionBackend(old.num_heads, old.num_kv_heads, old.head_dim,
                                           old.scale)
    model.use_triton_ops(False)
    torch_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert triton_tokens == torch_tokens


def test_hybrid_kv_layout_through_the_triton_kernels(tmp_path):
    """A tiny Gemma 3 (window 8: one full block table and three windowed ones,
    kv_cache/layout.py) with the Triton attention backend (interpreted on the CPU): the
    decode and prefill kernels read each layer's own table, the windowed tables' null entries
    behind the window included. Greedy tokens and logprobs equal the torch backend's, over
    prompts and generations past the window, prefill in chunks of 16."""
    import sys
    from pathlib import Path

    from argosy_runtime import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    try:
        from model_factory import make_random_model_dir
    finally:
        sys.path.pop(0)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    folder = make_random_model_dir(
        tmp_path, "gemma3", num_hidden_layers=4, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=True, rms_norm_eps=1e-6, init_std=0.15,
        extra_config=dict(sliding_window=8, layer_types=layer_types, query_pre_attn_scalar=24))
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    assert llm.engine.cache_config.layout.num_tables == 4
    runner = llm.engine.runner
    old = runner.backend
    prompts = [[(7 * i + 13 * j) % 40000 + 3 for j in range(n)] for i, n in enumerate((5, 27))]
    params = SamplingParams(temperature=0.0, max_tokens=14, logprobs=0, ignore_eos=True)

    def tokens_and_logprobs():
        return [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for c in (o.outputs[0] for o in llm.generate(prompts, params))]

    torch_out = tokens_and_logprobs()
    runner.backend = TritonAttentionBackend(old.num_heads, old.num_kv_heads, old.head_dim,
                                            old.scale)
    triton_out = tokens_and_logprobs()
    for (want_tokens, want_lp), (got_tokens, got_lp) in zip(torch_out, triton_out):
        assert got_tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
