"""w8a16_matmul / w4a16_matmul (Triton) against their references; the int4 packing layout."""

from __future__ import annotations

import pytest
import torch
from argosy_kernels import w4a16_matmul as w4a16_module
from argosy_kernels import w8a16_matmul as w8a16_module
from argosy_kernels.matmul_config import MatmulConfig
from argosy_kernels.w4a16_matmul import (
    DENSE_MIN_M,
    pack_int4,
    quantize_int4,
    unpack_int4,
    w4a16_dequantize,
    w4a16_dequantize_ref,
    w4a16_matmul,
    w4a16_matmul_ref,
)
from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref
from kernel_test_utils import DEVICE, DTYPES, assert_close, generator, randn

# Tolerances scale with the reduction length; fp16/bf16 kernels round the dequantized weight
# tile to the activation dtype before the tensor-core dot.
MM_SCALE = 4.0

# Both inner products (tensor cores, FMA), K split or not; None: the launcher's choice.
FMA = MatmulConfig(block_m=1, block_n=16, block_k=32, use_dot=False, split_k=1)
FMA_M4_SPLIT = MatmulConfig(block_m=4, block_n=32, block_k=16, use_dot=False, split_k=3)
DOT_SPLIT = MatmulConfig(block_m=16, block_n=32, block_k=32, split_k=3)
FMA_M2_SPLIT = MatmulConfig(block_m=2, block_n=16, block_k=32, use_dot=False, split_k=2)
CONFIGS = [None, FMA, FMA_M4_SPLIT, FMA_M2_SPLIT, DOT_SPLIT]
# w4a16's FMA kernel: one row of x per program, tiles of 32 * vec words (block_k at most).
GEMV = MatmulConfig(block_m=1, block_n=8, block_k=128, num_warps=1, use_dot=False, split_k=1)
GEMV_SPLIT = MatmulConfig(block_m=1, block_n=16, block_k=64, num_warps=1, use_dot=False,
                          split_k=3)
W4_CONFIGS = [None, GEMV, GEMV_SPLIT, DOT_SPLIT]


# w8a16's FMA kernel (use_dot=False; the configs above reach it too): tiles of block_k of K.
W8_GEMV = MatmulConfig(block_m=1, block_n=16, block_k=256, num_warps=1, use_dot=False,
                       split_k=1)
W8_GEMV_SPLIT = MatmulConfig(block_m=1, block_n=8, block_k=512, num_warps=1, use_dot=False,
                             split_k=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS + [W8_GEMV, W8_GEMV_SPLIT])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (5, 64, 128), (33, 16, 64),
                                           (2, 20, 1000)])  # K not a multiple of any tile
def test_w8a16_matches_reference(dtype, m, n, k, config):
    g = generator(m + n)
    x = randn(m, k, dtype=dtype, gen=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(n, generator=g) * 0.02).to(dtype=dtype, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = w8a16_matmul(x, w, scales, out=out, config=config)
    assert got is out
    want = w8a16_matmul_ref(x, w, scales)
    assert_close(got, want, dtype, scale=MM_SCALE)
    # The reference is the plain dequantized product.
    exact = x.double() @ (w.double() * scales.double()[:, None]).T
    assert_close(want, exact, dtype, scale=MM_SCALE)


def test_pack_int4_layout():
    # Nibble i of word (n, j) is w[n, i * K/8 + j].
    k = 32
    w = (torch.arange(2 * k) % 16).view(2, k)
    packed = pack_int4(w)
    assert packed.shape == (2, 4) and packed.dtype == torch.int32
    for n in range(2):
        for j in range(4):
            word = int(packed[n, j]) & 0xFFFFFFFF
            assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(w[n, i * 4 + j])
                                                                   for i in range(8)]
    g = generator(0)
    r = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(unpack_int4(pack_int4(r)).long(), r)
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 16))


def test_quantize_int4_round_trip():
    g = generator(1)
    w = torch.randn(8, 256, generator=g)
    qw, s, z = quantize_int4(w, 64)
    deq = w4a16_dequantize_ref(qw, s, z, 64)
    step = s.repeat_interleave(64, 1)
    assert ((deq - w).abs() <= step * 0.5 + step * 1e-3).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", W4_CONFIGS)
@pytest.mark.parametrize(
    ("m", "n", "k", "group_size"),
    [
        (1, 40, 256, 32),  # decode-like M=1; each (nibble, tile) inside one group
        (20, 48, 384, 64),  # groups straddle tiles (K/8 = 48 not a multiple of 64)
        (3, 32, 1024, 128),
        (2, 20, 2048, 64),  # FMA kernel: 2-word vectors, several tiles per split, N % 8 != 0
    ],
)
def test_w4a16_matches_reference(dtype, m, n, k, group_size, config):
    g = generator(k + m)
    x = randn(m, k, dtype=dtype, gen=g)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g)).to(DEVICE)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02).to(dtype=dtype, device=DEVICE)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).to(dtype=dtype, device=DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = w4a16_matmul(x, qweight, scales, zeros, group_size, out=out, config=config)
    assert got is out
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group_size)
    assert_close(got, want, dtype, scale=MM_SCALE)


def _random_int4(n: int, k: int, group_size: int, dtype: torch.dtype, seed: int):
    g = generator(seed)
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g)).to(DEVICE)
    scales = (torch.rand(n, k // group_size, generator=g) * 0.02).to(dtype=dtype, device=DEVICE)
    zeros = (torch.rand(n, k // group_size, generator=g) * 15).to(dtype=dtype, device=DEVICE)
    return qweight, scales, zeros


def _group_major(t: torch.Tensor) -> torch.Tensor:
    """The same [N, G] values, stored as the transpose of a contiguous [G, N]."""
    return t.T.contiguous().T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize(("n", "k", "group_size"), [
    (40, 8 * 72, 96),  # N and K8 not multiples of the tiles; groups straddle word tiles
    (40, 8 * 256, 128),  # each (nibble, word tile) inside one group: one scale per row
    (24, 8 * 64, 32),  # groups smaller than the kernel's usual word tile
])
def test_w4a16_dequantize_matches_reference(dtype, group_major, n, k, group_size):
    qweight, scales, zeros = _random_int4(n, k, group_size, dtype, seed=7)
    if group_major:
        scales, zeros = _group_major(scales), _group_major(zeros)
    got = w4a16_dequantize(qweight, scales, zeros, group_size, dtype)
    want = w4a16_dequantize_ref(qweight, scales, zeros, group_size)
    assert got.dtype == dtype
    assert_close(got, want.to(dtype), dtype)


@pytest.mark.parametrize("config", [None, GEMV_SPLIT, DOT_SPLIT])
@pytest.mark.parametrize(("m", "n", "k", "group_size"), [(1, 40, 256, 32), (5, 48, 384, 64),
                                                         (1, 24, 1024, 128)])
def test_w4a16_group_major_scales(config, m, n, k, group_size):
    # Scales and zeros as transposed views: the same values, other strides, same answer.
    qweight, scales, zeros = _random_int4(n, k, group_size, torch.bfloat16, seed=m + n)
    x = randn(m, k, dtype=torch.bfloat16, gen=generator(3))
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group_size)
    got = w4a16_matmul(x, qweight, _group_major(scales), _group_major(zeros), group_size,
                       config=config)
    assert_close(got, want, torch.bfloat16, scale=MM_SCALE)


def test_w4a16_many_rows_dequantize_once(monkeypatch):
    # On a GPU, M >= DENSE_MIN_M goes through w4a16_dequantize and a dense matmul: the
    # interpreter switch reads False here so the launcher routes as on a GPU.
    monkeypatch.setattr(w4a16_module, "interpret_mode", lambda: False)
    calls = []
    real = w4a16_module.w4a16_dequantize
    monkeypatch.setattr(w4a16_module, "w4a16_dequantize",
                        lambda *a: calls.append(a) or real(*a))
    qweight, scales, zeros = _random_int4(24, 128, 32, torch.float32, seed=8)
    x = randn(DENSE_MIN_M, 128, dtype=torch.float32, gen=generator(9))
    got = w4a16_matmul(x, qweight, scales, zeros, 32)
    assert len(calls) == 1
    assert_close(got, w4a16_matmul_ref(x, qweight, scales, zeros, 32), torch.float32,
                 scale=MM_SCALE)


@pytest.mark.parametrize(("k", "group_size", "vec"), [(1024, 128, 4), (512, 64, 2),
                                                      (256, 32, 1), (576, 32, None)])
def test_w4a16_one_row_runs_the_fma_kernel_where_its_tile_fits(monkeypatch, k, group_size, vec):
    # Decode's one row goes to the FMA kernel (one warp, 32 * vec words a tile, each inside one
    # group: 32 * vec divides the group size and K / 8); K / 8 = 72 has no such tile, and the
    # tensor-core kernel takes it. Fractional zero points: the kernel subtracts their part
    # from sums of x per group.
    monkeypatch.setattr(w4a16_module, "interpret_mode", lambda: False)
    launched = []
    for name in ("_w4a16_gemv_kernel", "_w4a16_matmul_kernel"):
        kernel = getattr(w4a16_module, name)
        monkeypatch.setattr(w4a16_module, name, _Spy(kernel, name, launched))
    qweight, scales, zeros = _random_int4(24, k, group_size, torch.float32, seed=k)
    x = randn(1, k, dtype=torch.float32, gen=generator(5))
    got = w4a16_matmul(x, qweight, scales, zeros, group_size)
    assert launched == ["_w4a16_gemv_kernel" if vec else "_w4a16_matmul_kernel"]
    assert w4a16_module.gemv_vec(128, group_size, k // 8) == vec
    assert_close(got, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), torch.float32,
                 scale=MM_SCALE)


def test_w8a16_one_row_runs_the_fma_kernel(monkeypatch):
    # Decode's one row goes to the FMA kernel, more rows to tensor cores.
    monkeypatch.setattr(w8a16_module, "interpret_mode", lambda: False)
    launched = []
    for name in ("_w8a16_gemv_kernel", "_w8a16_matmul_kernel"):
        kernel = getattr(w8a16_module, name)
        monkeypatch.setattr(w8a16_module, name, _Spy(kernel, name, launched))
    g = generator(6)
    w = torch.randint(-127, 128, (24, 512), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(24, generator=g) * 0.02).to(DEVICE)
    for m in (1, 2):
        x = randn(m, 512, dtype=torch.float32, gen=g)
        assert_close(w8a16_matmul(x, w, scales), w8a16_matmul_ref(x, w, scales), torch.float32,
                     scale=MM_SCALE)
    assert launched == ["_w8a16_gemv_kernel", "_w8a16_matmul_kernel"]
    with pytest.raises(ValueError, match="power of two"):
        w8a16_matmul(randn(1, 512, dtype=torch.float32, gen=g), w, scales,
                     config=MatmulConfig(block_m=1, block_n=8, block_k=96, use_dot=False))


class _Spy:
    """Records which kernel a launcher starts; the launch itself runs as before (under the
    interpreter: the test's switch only changes which configuration the launcher picks)."""

    def __init__(self, kernel, name: str, launched: list[str]) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_w4a16_reference_matches_unpacked_weights():
    g = generator(4)
    w_int = torch.randint(0, 16, (6, 64), generator=g)
    scales = torch.rand(6, 2, generator=g)
    zeros = torch.rand(6, 2, generator=g) * 15  # fractional zero points allowed
    x = torch.randn(3, 64, generator=g)
    dense = (w_int.double() - zeros.double().repeat_interleave(32, 1)) * \
        scales.double().repeat_interleave(32, 1)
    got = w4a16_matmul_ref(x, pack_int4(w_int), scales, zeros, 32)
    torch.testing.assert_close(got.double(), x.double() @ dense.T, atol=1e-4, rtol=1e-5)


def test_empty_and_bad_inputs():
    x = torch.zeros(0, 64, device=DEVICE)
    w = torch.zeros(8, 64, dtype=torch.int8, device=DEVICE)
    assert w8a16_matmul(x, w, torch.ones(8, device=DEVICE)).shape == (0, 8)
    qw = torch.zeros(8, 8, dtype=torch.int32, device=DEVICE)
    s = torch.ones(8, 2, device=DEVICE)
    assert w4a16_matmul(x, qw, s, s, 32).shape == (0, 8)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, qw, s, s, 24)
    with pytest.raises(ValueError, match="scales"):
        w8a16_matmul(x, w, torch.ones(4, device=DEVICE))


@pytest.mark.parametrize("m", [1, 3])
def test_int4_linear_cuda_layout_through_the_kernels(m):
    # What the engine hands the kernel on a GPU: Int4Linear's "cuda" layout, float32 scales
    # and zero points in the kernel's convention, activations in bfloat16. One row takes the
    # FMA kernel, three the tensor-core one; both equal the layer's own CPU product.
    from argosy_runtime.quantization.int4_linear import Int4Linear

    g = generator(11)
    lin = torch.nn.Linear(1024, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 1024, generator=g) * 0.05)
    layer = Int4Linear.from_linear(lin, 128)
    x = torch.randn(m, 1024, generator=g).to(torch.bfloat16)
    want = layer(x.float())
    layer.repack("cuda")
    # Group-major: neighbouring rows' scales side by side (what the one-row kernel wants).
    assert layer.kernel_scales.dtype == torch.float32 and layer.kernel_scales.stride(0) == 1
    assert layer.kernel_zeros.stride(0) == 1
    got = w4a16_matmul(x.to(DEVICE), layer.qweight.to(DEVICE), layer.kernel_scales.to(DEVICE),
                       layer.kernel_zeros.to(DEVICE), 128)
    assert_close(got.float().cpu(), want, torch.bfloat16, scale=MM_SCALE)
