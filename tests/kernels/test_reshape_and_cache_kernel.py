"""reshape_and_cache (Triton) against its reference; int8 quantization semantics."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from argosy_kernels.reshape_and_cache import (
    KV_SCALE_DTYPE,
    quantize_per_head_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from kernel_test_utils import DEVICE, DTYPES, HAS_CUDA, generator, randn

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 16, 2, 64
# Slots out of order, across blocks, the last row of a block, and a padded token (-1).
SLOTS = [3, 17, -1, 95, 16, 40, 0]


def test_scale_dtype_is_float16():
    # 2 bytes per token per head: 66 bytes vs bf16's 128 at head_dim 64 (1.94x the tokens).
    assert KV_SCALE_DTYPE == torch.float16


def _inputs(dtype, seed=0):
    g = generator(seed)
    key = randn(len(SLOTS), KV_HEADS, HEAD_DIM, dtype=dtype, gen=g)
    value = randn(len(SLOTS), KV_HEADS, HEAD_DIM, dtype=dtype, gen=g)
    slots = torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)
    return key, value, slots


def _poisoned(dtype):
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=dtype, device=DEVICE)  # never produced: +-127
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_exactly_the_mapped_slots(dtype):
    key, value, slots = _inputs(dtype)
    kc, vc = _poisoned(dtype), _poisoned(dtype)
    reshape_and_cache(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, KV_HEADS, HEAD_DIM), vc.view(-1, KV_HEADS, HEAD_DIM)
    for t, slot in enumerate(SLOTS):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[[s for s in SLOTS if s >= 0]] = False
    assert torch.isnan(flat_k[untouched.to(DEVICE)].float()).all()
    assert torch.isnan(flat_v[untouched.to(DEVICE)].float()).all()
    # The reference writes the same thing.
    kr, vr = _poisoned(dtype), _poisoned(dtype)
    reshape_and_cache_ref(key, value, kr, vr, slots)
    assert torch.equal(kr.nan_to_num(7.0), kc.nan_to_num(7.0))
    assert torch.equal(vr.nan_to_num(7.0), vc.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_quantization_matches_reference(dtype):
    key, value, slots = _inputs(dtype, seed=1)
    key[1, 0] = 0  # an all-zero head: scale 0, codes 0
    caches = [_poisoned(torch.int8) for _ in range(4)]
    scales = [torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS), float("nan"), dtype=torch.float16,
                         device=DEVICE) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale=scales[0],
                      v_scale=scales[1])
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots, k_scale=scales[2],
                          v_scale=scales[3])
    # Codes may differ by one where x / scale lands on a rounding tie (GPU division).
    tol = 1 if HAS_CUDA else 0
    assert (caches[0].int() - caches[2].int()).abs().max() <= tol
    assert (caches[1].int() - caches[3].int()).abs().max() <= tol
    torch.testing.assert_close(scales[0].nan_to_num(-1), scales[2].nan_to_num(-1))
    torch.testing.assert_close(scales[1].nan_to_num(-1), scales[3].nan_to_num(-1))
    if not HAS_CUDA:  # the interpreter computes exactly what the reference does
        for got, want in ((scales[0], scales[2]), (scales[1], scales[3])):
            assert torch.equal(got.nan_to_num(-1), want.nan_to_num(-1))
    # Padded token and untouched slots: cache and scales keep their poison.
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[[s for s in SLOTS if s >= 0]] = True
    written = written.to(DEVICE)
    assert (caches[0].view(-1, KV_HEADS, HEAD_DIM)[~written] == -128).all()
    assert torch.isnan(scales[0].view(-1, KV_HEADS)[~written]).all()
    assert (caches[0].view(-1, KV_HEADS, HEAD_DIM)[written] != -128).all()


def test_quantize_per_head_semantics():
    # max|x| = 127 / 16: the scale 1/16 is exact in float16, so x / scale lands on the ties
    # 0.5 and -2.5, which round away from zero (torch.round would give 0 and -2).
    x = torch.tensor([[[7.9375, 0.03125, -0.15625, 0.0]],
                      [[0.0, 0.0, 0.0, 0.0]]])  # [2 tokens, 1 head, 4]
    q, s = quantize_per_head_ref(x)
    assert s.dtype == torch.float16
    assert torch.equal(s, torch.tensor([[1 / 16], [0.0]], dtype=torch.float16))
    assert q[0, 0].tolist() == [127, 1, -3, 0]
    assert q[1, 0].tolist() == [0, 0, 0, 0]
    # A scale float16 cannot hold exactly: stored rounded to nearest, codes against it.
    q, s = quantize_per_head_ref(torch.tensor([[1.0, -2.0, 0.5, 0.0]]))
    assert s.item() == torch.tensor(2.0 / 127).half().item() != 2.0 / 127
    assert q[0].tolist() == [64, -127, 32, 0]  # 1 / s = 63.504 -> 64; 0.5 / s = 31.75 -> 32


@pytest.mark.parametrize("magnitude", [1e-2, 1.0, 300.0])
def test_quantize_round_trip_error_bound(magnitude):
    """Dequantized q * s (both upcast to float32) is within half a step of x, and a step
    is at most max|x| / 127 rounded to float16 (relative error <= 2**-11)."""
    g = generator(5)
    y = torch.randn(50, 4, 64, generator=g) * magnitude
    qy, sy = quantize_per_head_ref(y)
    assert qy.dtype == torch.int8 and sy.dtype == torch.float16
    step = sy.float()[..., None]
    err = (qy.float() * step - y).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()
    amax = y.abs().amax(-1)
    assert ((sy.float() - amax / 127).abs() <= amax / 127 * 2**-11).all()
    # Quantizing against the float32 scale and dequantizing with the float16 one would break
    # the half-step bound on some elements: the codes must be rounded against the stored scale.
    naive = torch.round(y * (127 / amax)[..., None]).clamp(-127, 127)
    assert ((naive * step - y).abs() > step / 2 * (1 + 1e-6)).any()


def test_quantize_extremes_stay_finite():
    # Scales beyond float16's range clamp to 65504 (codes saturate); scales below its
    # subnormals flush to 0 and the codes to 0: no inf, no NaN.
    x = torch.tensor([[1e7, -5e6, 0.0], [1e-9, -1e-9, 0.0]])
    q, s = quantize_per_head_ref(x)
    assert s.tolist() == [65504.0, 0.0]
    assert q[0].tolist() == [127, -76, 0] and q[1].tolist() == [0, 0, 0]
    # The kernel agrees.
    key = x.view(2, 1, 3).to(DEVICE)
    kc = torch.zeros(1, 2, 1, 3, dtype=torch.int8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks = torch.full((1, 2, 1), float("nan"), dtype=torch.float16, device=DEVICE)
    vs = ks.clone()
    reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1], device=DEVICE), k_scale=ks,
                      v_scale=vs)
    assert ks.view(-1).tolist() == [65504.0, 0.0] and torch.equal(ks, vs)
    assert torch.equal(kc.view(2, 3).cpu(), q) and torch.equal(vc, kc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_cache_end_to_end_with_decode_attention(dtype):
    """Write a whole sequence's K/V through the int8 path, then attend: close to full precision."""
    g = generator(8)
    seq_len, num_heads = 40, 4
    key = randn(seq_len, KV_HEADS, HEAD_DIM, dtype=dtype, gen=g)
    value = randn(seq_len, KV_HEADS, HEAD_DIM, dtype=dtype, gen=g)
    table = torch.tensor([[4, 1, 5]], dtype=torch.int32, device=DEVICE)
    slots = (table[0, torch.arange(seq_len, device=DEVICE) // BLOCK_SIZE].long() * BLOCK_SIZE
             + torch.arange(seq_len, device=DEVICE) % BLOCK_SIZE)
    kq, vq = _poisoned(torch.int8), _poisoned(torch.int8)
    ks = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, dtype=torch.float16, device=DEVICE)
    vs = torch.zeros_like(ks)
    reshape_and_cache(key, value, kq, vq, slots, k_scale=ks, v_scale=vs)
    kf, vf = _poisoned(dtype), _poisoned(dtype)
    reshape_and_cache(key, value, kf, vf, slots)
    query = randn(1, num_heads, HEAD_DIM, dtype=dtype, gen=g)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, kq, vq, table, lens, HEAD_DIM**-0.5, k_scale=ks,
                                 v_scale=vs)
    want = paged_decode_attention_ref(query, kf, vf, table, lens, HEAD_DIM**-0.5)
    assert (got.float() - want.float()).abs().max() < 0.05


def test_empty_and_bad_inputs():
    key, value, slots = _inputs(torch.float32)
    kc, vc = _poisoned(torch.float32), _poisoned(torch.float32)
    reshape_and_cache(key[:0], value[:0], kc, vc, slots[:0])
    assert torch.isnan(kc).all()
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, value, kc, vc, slots[:3])
    with pytest.raises(ValueError, match="k_scale"):
        reshape_and_cache(key, value, _poisoned(torch.int8), _poisoned(torch.int8), slots)
    # float32 scales (the old layout) are refused, not silently written as float16 bits.
    fp32 = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, device=DEVICE)
    with pytest.raises(ValueError, match="float16"):
        reshape_and_cache(key, value, _poisoned(torch.int8), _poisoned(torch.int8), slots,
                          k_scale=fp32, v_scale=fp32.clone())


def test_reference_refuses_an_int8_cache_without_scales():
    """Like the kernel: a plain cast into the int8 cache would store truncated values
    (0.7 -> 0) that readers then scale by whatever k_scale held."""
    key, value, slots = _inputs(torch.float32)
    kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.int8, device=DEVICE)
    scale = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, dtype=KV_SCALE_DTYPE, device=DEVICE)
    for scales in ({}, {"k_scale": scale}, {"v_scale": scale}):
        with pytest.raises(ValueError, match="k_scale and v_scale"):
            reshape_and_cache_ref(key, value, kc, kc.clone(), slots, **scales)
    assert not kc.any()
