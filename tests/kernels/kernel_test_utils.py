"""Shared helpers for the kernel tests: device, tolerances, random paged caches."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (atol, rtol) per dtype. Under the interpreter a float32 -> bfloat16 store truncates instead
# of rounding, so bf16 allows two ulps.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> None:
    """Compare within the dtype's tolerance (times `scale`); a NaN anywhere fails."""
    atol, rtol = TOL[dtype]
    assert not torch.isnan(actual).any(), "output holds NaN (an element left unwritten?)"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * scale,
                               rtol=rtol * scale)


def generator(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def random_block_tables(context_lens: list[int], block_size: int, num_blocks: int,
                        gen: torch.Generator, extra_cols: int = 1) -> torch.Tensor:
    """int32 [num_seqs, max_blocks]: disjoint, shuffled blocks per sequence; spare columns
    point at block 0 (never read)."""
    need = [-(-n // block_size) for n in context_lens]
    width = max(need, default=0) + extra_cols
    perm = torch.randperm(num_blocks, generator=gen)
    if sum(need) > num_blocks:
        raise ValueError("not enough blocks for the test case")
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return table.to(DEVICE)


def dense_kv(cache: torch.Tensor, table_row: torch.Tensor, length: int,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's [length, num_kv_heads, head_dim] float64 K or V, token by token (slow and
    obvious: an independent check of the gather in the references)."""
    block_size = cache.shape[1]
    rows = []
    for t in range(length):
        b, off = int(table_row[t // block_size]), t % block_size
        x = cache[b, off].double()
        if scale is not None:
            x = x * scale[b, off].double()[:, None]
        rows.append(x)
    return torch.stack(rows)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [num_heads, d] against k/v [n, num_kv_heads, d], float64, GQA by head // group."""
    num_heads, num_kv_heads = q.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    out = []
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        p = torch.softmax((kh @ q[h].double()) * scale, dim=0)
        out.append(p @ vh)
    return torch.stack(out)
