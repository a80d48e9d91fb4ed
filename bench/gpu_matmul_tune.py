"""Time launch configurations of the quantized matmul kernels on one CUDA GPU (a few minutes).

For w8a16 and w4a16 (group 128) at Llama-3-8B's shapes and M = 1, 4, 16, 64, 256, every
candidate is checked against the float32 reference on fresh random inputs (output poisoned
with NaN first) and timed against bf16 torch.matmul: "default" (the fused kernel as
default_config launches it), for M <= 8 the one-warp FMA kernels' tiles and the tensor-core
kernel for comparison, tensor-core tile shapes from M = 16
(matmul_config.MatmulConfig), and "dense" (dequantize the whole weight once, then
cuBLAS: what w4a16_matmul does from DENSE_MIN_M rows); w4a16 also with its scales and zeros
stored group-major ("w4gn": [K // 128, N] contiguous, so neighbouring columns' scales are
neighbours in memory and a warp's scale loads coalesce; what Int4Linear keeps on CUDA), both
in float32 as Int4Linear keeps them. Weights rotate over enough copies to
exceed the L2 cache several times, as a model's layers do. Set default_config and DENSE_MIN_M
from its table and record it in docs/benchmarks/gpu.md. Not yet run on a GPU.

    python bench/gpu_matmul_tune.py --out gpu_matmul_tune.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from argosy_runtime.benchmarks.cuda_timing import copies_beyond_l2, cuda_seconds_per_call

BF16 = torch.bfloat16
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
GROUP = 128

# The one-row FMA kernels (one warp, one row of x per program): (block_n, block_k), block_k
# in int32 words for w4a16 (8 K each), in K for w8a16.
GEMV = {"w4": [(4, 128), (8, 128), (16, 128), (8, 64)],
        "w8": [(8, 256), (16, 256), (32, 256), (8, 512)]}
# (block_n, block_k, num_warps, num_stages) for the tensor-core path.
DOT = {
    # (64, 32, 4, 2): the default's tile without its 16-byte spill (float32 scales, sm_90).
    "w4": [(64, 32, 4, 3), (32, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 8, 4),
           (128, 32, 8, 3), (64, 32, 4, 2)],
    "w8": [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (64, 128, 8, 4),
           (128, 64, 8, 3)],
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_matmul_tune.json")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="stop starting new (kind, shape, M) cases after this many seconds")
    return p.parse_args()


def candidates(kind: str, m: int) -> list[tuple[str, Any]]:
    """(name, config) to time for `kind` ("w4", "w8", or "w4gn": w4a16 with group-major
    scales and zeros, for which a few of w4's configs are enough to compare the layouts)."""
    if kind == "w4gn":
        w4 = candidates("w4", m)
        return w4[:2] + [c for c in w4[2:] if "split" not in c[0] or c[0].endswith("split1")][:5]
    from argosy_kernels.matmul_config import MatmulConfig
    from argosy_kernels.w4a16_matmul import default_config as w4_default
    from argosy_kernels.w8a16_matmul import default_config as w8_default

    default = w4_default(m, BF16, GROUP) if kind == "w4" else w8_default(m, BF16)
    out: list[tuple[str, Any]] = [("default", default), ("dense", "dense")]
    if m <= 8:
        # The tensor-core kernel at 16 rows (the default before the FMA kernels), and the FMA
        # kernel's tiles, K in 1, 2 or 4 splits ("default" has the launcher's choice).
        dot = (16, 64, 32) if kind == "w4" else (16, 64, 64)
        out.append((f"dot bm{dot[0]} bn{dot[1]} bk{dot[2]} w4 s3", MatmulConfig(*dot)))
        for bn, bk in GEMV[kind]:
            for split in (1, 2, 4):
                out.append((f"gemv bn{bn} bk{bk} split{split}",
                            MatmulConfig(block_m=1, block_n=bn, block_k=bk, num_warps=1,
                                         use_dot=False, split_k=split)))
    else:
        bm = 16 if m <= 16 else 64
        for bn, bk, warps, stages in DOT[kind]:
            out.append((f"dot bm{bm} bn{bn} bk{bk} w{warps} s{stages}",
                        MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                     num_stages=stages)))
    return out


def make_call(kind: str, cfg: Any, x: torch.Tensor, ws: tuple, out: torch.Tensor
              ) -> Callable[[], Any]:
    """out = x @ W.T for one weight copy `ws`, by `kind` ("bf16", "w4", "w8") and config."""
    from argosy_kernels.w4a16_matmul import w4a16_dequantize, w4a16_matmul
    from argosy_kernels.w8a16_matmul import w8a16_matmul

    if kind == "bf16":
        return lambda: torch.matmul(x, ws[0].T, out=out)
    if cfg == "dense" and kind in ("w4", "w4gn"):
        return lambda: torch.matmul(x, w4a16_dequantize(*ws, GROUP, BF16).T, out=out)
    if cfg == "dense":
        return lambda: torch.matmul(x, (ws[0].to(BF16) * ws[1][:, None]).T, out=out)
    if kind in ("w4", "w4gn"):
        return lambda: w4a16_matmul(x, *ws, GROUP, out=out, config=cfg)
    return lambda: w8a16_matmul(x, *ws, out=out, config=cfg)


def _weights(n: int, k: int, g: torch.Generator, dev: torch.device) -> dict[str, list]:
    """Copies of random [n, k] weights per kind, together beyond the L2 several times."""
    from argosy_kernels.w4a16_matmul import pack_int4

    copies = copies_beyond_l2(n * k // 2)
    # float32 scales and zero points, as Int4Linear keeps them on CUDA.
    w4 = [(pack_int4(torch.randint(0, 16, (n, k), generator=g, device=dev)),
           torch.rand(n, k // GROUP, generator=g, device=dev) * 0.01,
           torch.rand(n, k // GROUP, generator=g, device=dev) * 15)
          for _ in range(copies)]
    return {
        "w4": w4,
        # The same values with scales and zeros stored group-major ([G, N] contiguous).
        "w4gn": [(qw, s.T.contiguous().T, z.T.contiguous().T) for qw, s, z in w4],
        "w8": [(torch.randint(-127, 128, (n, k), generator=g, device=dev, dtype=torch.int8),
                (torch.rand(n, generator=g, device=dev) * 1e-3).to(BF16))
               for _ in range(max(2, copies // 2))],
        "bf16": [torch.randn(n, k, generator=g, device=dev).to(BF16)
                 for _ in range(max(2, copies // 4))],
    }


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("gpu_matmul_tune: no CUDA GPU visible", file=sys.stderr)
        return 2
    from argosy_kernels.w4a16_matmul import w4a16_dequantize_ref

    dev = torch.device("cuda")
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    g = torch.Generator(device=dev).manual_seed(0)
    weights_of = {shape: _weights(*shape, g, dev) for shape in SHAPES}
    # One row first (the target), then the batch sizes that decide DENSE_MIN_M, each
    # over every shape, so a budget that runs out cuts rows of M, not whole shapes.
    for m in (1, 16, 64, 4, 256):
        for n, k in SHAPES:
            if time.monotonic() - t0 > args.budget_s:
                print(f"budget: skipped {n}x{k} M={m}", flush=True)
                continue
            weights_of_kind = weights_of[n, k]
            x = torch.randn(m, k, generator=g, device=dev).to(BF16)
            out = torch.empty(m, n, dtype=BF16, device=dev)
            # Three rounds over the weight copies per captured graph.
            t_bf16 = cuda_seconds_per_call([make_call("bf16", None, x, (w,), out)
                                            for w in weights_of_kind["bf16"]] * 3)
            w4, w8 = weights_of_kind["w4"][0], weights_of_kind["w8"][0]
            want = {"w4": (x.float() @ w4a16_dequantize_ref(*w4, GROUP).T),
                    "w8": (x.float() @ (w8[0].float() * w8[1].float()[:, None]).T)}
            for kind in ("w4", "w4gn", "w8"):
                weights = weights_of_kind[kind]
                for name, cfg in candidates(kind, m):
                    row = {"kind": kind, "n": n, "k": k, "m": m, "config": name,
                           "bf16_us": round(t_bf16 * 1e6, 2)}
                    try:
                        out.fill_(float("nan"))
                        make_call(kind, cfg, x, weights[0], out)()
                        ref = want[kind[:2]]
                        err = float((out.float() - ref).norm() / ref.norm())
                        row["rel_err"] = err
                        if not err < 2e-2:
                            row["error"] = f"rel err {err:.2e}"
                        else:
                            t = cuda_seconds_per_call([make_call(kind, cfg, x, ws, out)
                                                       for ws in weights] * 3)
                            row["us"] = round(t * 1e6, 2)
                            row["speedup_vs_bf16"] = round(t_bf16 / t, 3)
                    except Exception as e:  # noqa: BLE001 - record it, try the next config
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    results.append(row)
            print(f"[{time.monotonic() - t0:6.1f}s] {n}x{k} M={m} done", flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print("\n== best per case (speedup vs bf16 torch.matmul, rotating weights) ==")
    cases: dict[tuple, list[dict]] = {}
    for r in results:
        cases.setdefault((r["kind"], r["n"], r["k"], r["m"]), []).append(r)
    for (kind, n, k, m), rows in cases.items():
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        default = next((r for r in rows if r["config"] == "default"), {})
        errors = sum(1 for r in rows if "error" in r)
        best = " | ".join(f"{r['config']} {r['us']:.1f}us {r['speedup_vs_bf16']:.2f}x"
                          for r in ok[:3])
        print(f"{kind} {k}->{n} M={m:<3d} bf16 {rows[0]['bf16_us']:.1f}us default "
              f"{default.get('us', 'ERR')}us | {best} | errors {errors}")
    print(f"wrote {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
