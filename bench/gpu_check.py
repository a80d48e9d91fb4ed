"""GPU check for argosy_kernels and the CUDA decode path (one H100/H200, about 8 minutes).

Sections, in order (each is timed and recorded; a failing section is recorded, not fatal):
  1. device: copy bandwidth (device-to-device, read + write bytes) and the bf16 matmul rate;
  2. correctness: every Triton kernel against its torch reference at production shapes
     (Llama-3-8B: 32 query / 8 kv heads, head_dim 128, hidden 4096, intermediate 14336);
  3. decode attention: achieved GB/s (K/V bytes read) at batch 1/16/64/256, context 512-8192,
     against the measured copy bandwidth;
  4. matmul: w4a16 / w8a16 against bf16 torch.matmul at M = 1/16/64/256, 4096x4096,
     4096->14336 and 14336->4096;
  5. engine: greedy tokens of the embedded model in float32, torch attention vs Triton, and
     vs the engine as served on CUDA (its own kernels, CUDA graphs);
  6. end to end: decode tokens/s of a random-weight Llama-3-8B-shaped model (runtime classes,
     Triton attention, CUDA graphs) in bf16 / int8 / int4 at batch 1 and 64, against the
     roofline (weight + KV bytes read per step / measured bandwidth).
Prints one table and writes JSON (--out). Targets (reported, not enforced): decode attention
>= 70% of copy bandwidth at batch 64 / context 4096; int4 >= 2.5x bf16 at M=1; batch-1
decode >= 60% of the roofline.

Without a CUDA GPU it exits with status 2 and a message. `--smoke` runs every section at toy
shapes on the CPU under Triton's interpreter (the engine section: one prompt, three tokens),
to check the script itself (its numbers mean nothing and are labelled so).

    python bench/gpu_check.py --out docs/benchmarks/gpu_check.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="JSON results path")
    p.add_argument("--smoke", action="store_true",
                   help="toy shapes on the CPU under TRITON_INTERPRET=1 (checks the script)")
    p.add_argument("--skip", default="", help="comma-separated sections to skip "
                   "(device,correctness,decode_attention,matmul,engine,engine_graphs,e2e)")
    p.add_argument("--model", default="smollm2-135m",
                   help="model of the engine section (an alias, HF folder or .gguf; default: "
                   "the embedded smollm2-135m; bench/truncate_gguf.py makes one small enough "
                   "to carry to a lent GPU machine)")
    p.add_argument("--budget-s", type=float, default=460.0,
                   help="stop starting optional measurements after this many seconds")
    return p.parse_args()


ARGS = _parse()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402  (TRITON_INTERPRET must be set first)
from argosy_runtime.benchmarks.cuda_timing import (  # noqa: E402
    copies_beyond_l2,
    cuda_seconds_per_call,
)

SMOKE = ARGS.smoke
T0 = time.monotonic()
RESULTS: dict[str, Any] = {"smoke": SMOKE, "sections": {}}
ROWS: list[tuple[str, str, str]] = []  # (section, item, value) for the final table


def elapsed() -> float:
    return time.monotonic() - T0


def over_budget() -> bool:
    return elapsed() > ARGS.budget_s


def row(section: str, item: str, value: str) -> None:
    ROWS.append((section, item, value))
    print(f"[{elapsed():6.1f}s] {section:17s} {item:44s} {value}", flush=True)


# ---- timing ------------------------------------------------------------------------------
def time_fn(fn: Callable[[], Any], iters: int = 20, reps: int = 5, capture: bool = True) -> float:
    """Median seconds per call of fn. On CUDA: `iters` calls captured in one CUDA graph
    (no launch overhead in the number), replayed `reps` times between events; a plain loop
    between events when capture=False or capture fails."""
    if SMOKE:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    calls = [fn] * iters
    if capture:
        try:
            return cuda_seconds_per_call(calls, reps)
        except Exception:  # noqa: BLE001 - some callables cannot be captured: time them eagerly
            torch.cuda.synchronize()
    return cuda_seconds_per_call(calls, reps, capture=False)


def section(name: str) -> Callable[[Callable[[], dict]], Callable[[], None]]:
    def wrap(fn: Callable[[], dict]) -> Callable[[], None]:
        def run() -> None:
            if name in ARGS.skip.split(","):
                RESULTS["sections"][name] = {"skipped": "--skip"}
                return
            start = elapsed()
            try:
                out = fn()
                out["seconds"] = round(elapsed() - start, 1)
                RESULTS["sections"][name] = out
            except Exception as e:  # noqa: BLE001 - record and go on with the next section
                traceback.print_exc()
                RESULTS["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                             "seconds": round(elapsed() - start, 1)}
                row(name, "ERROR", f"{type(e).__name__}: {e}"[:120])
        return run
    return wrap


DEV = torch.device("cpu" if SMOKE else "cuda")
BF16 = torch.bfloat16
# Production shapes (Llama-3-8B), or toys in smoke mode.
if SMOKE:
    H, KVH, D, HIDDEN, INTER, BS = 4, 2, 32, 64, 128, 16
else:
    H, KVH, D, HIDDEN, INTER, BS = 32, 8, 128, 4096, 14336, 16


# ---- 1. device -----------------------------------------------------------------------------
@section("device")
def device_section() -> dict:
    if SMOKE:
        RESULTS["copy_gbps"] = 1.0
        return {"device": "cpu (smoke)", "copy_gbps": 1.0, "bf16_tflops": None}
    props = torch.cuda.get_device_properties(0)
    # The ceiling the other sections are held to: a copy far larger than the L2 (60 MB), by
    # the copy engine path (copy_) and by an elementwise kernel; the faster of the two.
    nbytes = 2 << 30
    src = torch.randn(nbytes // 4, device=DEV)
    dst = torch.empty_like(src)
    t_copy = time_fn(partial(dst.copy_, src), iters=5)
    t_kernel = time_fn(partial(torch.mul, src, 1.0, out=dst), iters=5)
    copy_gbps = 2 * nbytes / min(t_copy, t_kernel) / 1e9  # each byte read once, written once
    src = dst = torch.empty(0)
    n = 8192
    a = torch.randn(n, n, dtype=BF16, device=DEV)
    b = torch.randn(n, n, dtype=BF16, device=DEV)
    t_mm = time_fn(partial(torch.matmul, a, b), iters=10)
    tflops = 2 * n**3 / t_mm / 1e12
    RESULTS["copy_gbps"] = copy_gbps
    row("device", props.name, f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    row("device", "copy bandwidth (read+write, 2 GiB)",
        f"{copy_gbps:.0f} GB/s (copy_ {2 * nbytes / t_copy / 1e9:.0f}, "
        f"elementwise {2 * nbytes / t_kernel / 1e9:.0f})")
    row("device", "bf16 matmul 8192^3", f"{tflops:.0f} TFLOP/s")
    return {"device": props.name, "sms": props.multi_processor_count,
            "copy_gbps": round(copy_gbps, 1), "bf16_tflops": round(tflops, 1),
            "torch": torch.__version__}


# ---- 2. correctness --------------------------------------------------------------------------
def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


@section("correctness")
def correctness_section() -> dict:
    from argosy_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
    from argosy_kernels.paged_prefill_attention import (
        paged_prefill_attention,
        paged_prefill_attention_ref,
    )
    from argosy_kernels.reshape_and_cache import (
        quantize_per_head_ref,
        reshape_and_cache,
        reshape_and_cache_ref,
    )
    from argosy_kernels.rms_norm import rms_norm, rms_norm_ref
    from argosy_kernels.rotary_embedding import (
        build_cos_sin_cache,
        rotary_embedding,
        rotary_embedding_ref,
    )
    from argosy_kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
    from argosy_kernels.w4a16_matmul import quantize_int4, w4a16_matmul, w4a16_matmul_ref
    from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref

    g = torch.Generator(device=DEV).manual_seed(0)
    out: dict[str, Any] = {}
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, BF16: 3e-2}

    def check(name: str, err: float, limit: float) -> None:
        ok = err <= limit and math.isfinite(err)
        out[name] = {"max_rel_err": err, "limit": limit, "ok": ok}
        row("correctness", name, f"{'ok  ' if ok else 'FAIL'} max rel err {err:.2e} (<= {limit:.0e})")

    def rnd(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV).to(dtype)

    max_ctx = 64 if SMOKE else 4096
    batch = 3 if SMOKE else 16
    for dtype, block_size, int8 in ((BF16, 16, False), (torch.float16, 32, False),
                                    (BF16, 16, True), (torch.float32, 16, False)):
        lens = torch.randint(1, max_ctx + 1, (batch,), generator=g, device=DEV).to(torch.int32)
        lens[0] = 1
        lens[-1] = max_ctx
        nblk = -(-max_ctx // block_size)
        num_blocks = batch * nblk + 1
        kc = rnd(num_blocks, block_size, KVH, D, dtype=dtype)
        vc = rnd(num_blocks, block_size, KVH, D, dtype=dtype)
        scales: dict[str, torch.Tensor] = {}
        if int8:
            kc, ks = quantize_per_head_ref(kc)
            vc, vs = quantize_per_head_ref(vc)
            scales = {"k_scale": ks, "v_scale": vs}
        tables = torch.randperm(num_blocks - 1, generator=g, device=DEV)[: batch * nblk]
        tables = (tables + 1).view(batch, nblk).to(torch.int32)
        q = rnd(batch, H, D, dtype=dtype)
        name = f"decode {str(dtype)[6:]} bs{block_size}{' int8kv' if int8 else ''}"
        want = paged_decode_attention_ref(q, kc, vc, tables, lens, D**-0.5, **scales)
        for splits in (1, None):
            got = paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, num_splits=splits,
                                         **scales)
            check(f"{name} splits={'auto' if splits is None else 1}", _max_rel(got, want),
                  tol[dtype])

    q_lens, seq_lens = ([5, 1, 9], [5, 30, 40]) if SMOKE else ([512, 1, 300, 77],
                                                               [512, 1000, 1324, 77])
    nblk = max(-(-s // BS) for s in seq_lens)
    num_blocks = len(seq_lens) * nblk + 1
    kc, vc = rnd(num_blocks, BS, KVH, D), rnd(num_blocks, BS, KVH, D)
    tables = (torch.randperm(num_blocks - 1, generator=g, device=DEV)[: len(seq_lens) * nblk]
              + 1).view(len(seq_lens), nblk).to(torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = rnd(sum(q_lens), H, D)
    check("prefill bf16", _max_rel(paged_prefill_attention(q, kc, vc, tables, qsl, sl, D**-0.5),
                                   paged_prefill_attention_ref(q, kc, vc, tables, qsl, sl, D**-0.5)),
          tol[BF16])

    ntok = 20 if SMOKE else 512
    k, v = rnd(ntok, KVH, D), rnd(ntok, KVH, D)
    slots = torch.randperm(num_blocks * BS, generator=g, device=DEV)[:ntok]
    caches = [torch.zeros(num_blocks, BS, KVH, D, dtype=BF16, device=DEV) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_ref(k, v, caches[2], caches[3], slots)
    check("reshape_and_cache bf16", _max_rel(caches[0], caches[2]), 0.0)
    qc = [torch.zeros(num_blocks, BS, KVH, D, dtype=torch.int8, device=DEV) for _ in range(4)]
    sc = [torch.zeros(num_blocks, BS, KVH, dtype=torch.float16, device=DEV) for _ in range(4)]
    reshape_and_cache(k, v, qc[0], qc[1], slots, k_scale=sc[0], v_scale=sc[1])
    reshape_and_cache_ref(k, v, qc[2], qc[3], slots, k_scale=sc[2], v_scale=sc[3])
    code_diff = int((qc[0].int() - qc[2].int()).abs().max())
    check("reshape_and_cache int8 (codes, scales)", max(code_diff / 127, _max_rel(sc[0], sc[2])),
          1 / 127)

    x, w, r = rnd(ntok, HIDDEN), rnd(HIDDEN), rnd(ntok, HIDDEN)
    r1, r2 = r.clone(), r.clone()
    o1, _ = rms_norm(x, w, 1e-5, r1)
    o2, _ = rms_norm_ref(x, w, 1e-5, r2)
    check("rms_norm + residual bf16", max(_max_rel(o1, o2), _max_rel(r1, r2)), tol[BF16])
    gate_up = rnd(5, 2 * INTER)
    check("silu_and_mul bf16", _max_rel(silu_and_mul(gate_up), silu_and_mul_ref(gate_up)),
          tol[BF16])

    cs = build_cos_sin_cache(D, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (ntok,), generator=g, device=DEV)
    qr, kr = rnd(ntok, H, D), rnd(ntok, KVH, D)
    q2, k2 = qr.clone(), kr.clone()
    rotary_embedding(pos, qr, kr, cs)
    rotary_embedding_ref(pos, q2, k2, cs)
    check("rotary bf16", max(_max_rel(qr, q2), _max_rel(kr, k2)), tol[BF16])

    m = 16
    x = rnd(m, HIDDEN)
    w8 = torch.randint(-127, 128, (HIDDEN, HIDDEN), generator=g, device=DEV, dtype=torch.int8)
    s8 = (torch.rand(HIDDEN, generator=g, device=DEV) * 1e-3).to(BF16)
    check(f"w8a16 M=16 {HIDDEN}x{HIDDEN}", _max_rel(w8a16_matmul(x, w8, s8), w8a16_matmul_ref(x, w8, s8)),
          tol[BF16])
    qw, s4, z4 = quantize_int4(rnd(INTER, HIDDEN), 128 if not SMOKE else 32)
    gs = 128 if not SMOKE else 32
    check(f"w4a16 M=16 {HIDDEN}->{INTER} g{128 if not SMOKE else 32}", _max_rel(w4a16_matmul(x, qw, s4, z4, gs),
                                                   w4a16_matmul_ref(x, qw, s4, z4, gs)), tol[BF16])
    # One row: decode's FMA kernels (each launcher's own choice at M = 1).
    check(f"w8a16 M=1 {HIDDEN}x{HIDDEN}", _max_rel(w8a16_matmul(x[:1], w8, s8),
                                                   w8a16_matmul_ref(x[:1], w8, s8)), tol[BF16])
    check(f"w4a16 M=1 {HIDDEN}->{INTER} g{gs}", _max_rel(w4a16_matmul(x[:1], qw, s4, z4, gs),
                                                         w4a16_matmul_ref(x[:1], qw, s4, z4, gs)),
          tol[BF16])
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


# ---- 3. decode attention bandwidth --------------------------------------------------------
@section("decode_attention")
def decode_attention_section() -> dict:
    from argosy_kernels.paged_attention import paged_decode_attention

    batches, contexts = ((1, 4), (32, 64)) if SMOKE else ((1, 16, 64, 256),
                                                          (512, 1024, 2048, 4096, 8192))
    max_tokens = max(batches) * max(contexts)
    num_blocks = max_tokens // BS + 1
    # Cache values do not change the timing: zeros (no NaN in the softmax either).
    kc = torch.zeros(num_blocks, BS, KVH, D, dtype=BF16, device=DEV)
    vc = torch.zeros_like(kc)
    copy_gbps = RESULTS.get("copy_gbps") or float("nan")
    g = torch.Generator(device=DEV).manual_seed(1)
    out = []
    configs = [(b, ctx) for b in batches for ctx in contexts]
    # The target configuration first, so a tight time budget never skips it.
    configs.sort(key=lambda c: c != (64, 4096))
    for b, ctx in configs:
        if over_budget():
            row("decode_attention", f"b={b} ctx={ctx}", "skipped (time budget)")
            continue
        nblk = ctx // BS
        tables = torch.randperm(num_blocks - 1, generator=g, device=DEV)[: b * nblk]
        tables = (tables + 1).view(b, nblk).to(torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(b, H, D, dtype=BF16, device=DEV)
        o = torch.empty_like(q)
        t = time_fn(partial(paged_decode_attention, q, kc, vc, tables, lens, D**-0.5, out=o))
        nbytes = b * ctx * KVH * D * 2 * 2 + 2 * q.numel() * 2 + tables.numel() * 4
        gbps = nbytes / t / 1e9
        frac = gbps / copy_gbps
        out.append({"batch": b, "context": ctx, "us": round(t * 1e6, 1),
                    "gbps": round(gbps, 1), "frac_of_copy": round(frac, 3)})
        row("decode_attention", f"b={b:<3d} ctx={ctx:<5d}",
            f"{t * 1e6:8.1f} us {gbps:7.0f} GB/s {100 * frac:5.1f}% of copy")
    target = [r for r in out if r["batch"] == 64 and r["context"] == 4096]
    return {"runs": out,
            "target_b64_ctx4096_ge_70pct": (target[0]["frac_of_copy"] >= 0.7) if target else None}


# ---- 4. quantized matmul ---------------------------------------------------------------------
def _matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.T)


def _time_rotating(fn: Callable[..., Any], arg_sets: list[tuple]) -> float:
    """Median seconds per call of fn(*args), args cycling through arg_sets (two rounds per
    captured graph)."""
    cycle = itertools.cycle(arg_sets)
    return time_fn(lambda: fn(*next(cycle)), iters=2 * len(arg_sets))


@section("matmul")
def matmul_section() -> dict:
    from argosy_kernels.w4a16_matmul import pack_int4, w4a16_matmul
    from argosy_kernels.w8a16_matmul import w8a16_matmul

    ms = (1, 16) if SMOKE else (1, 16, 64, 256)
    shapes = ((HIDDEN, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))  # (N, K)
    gs = 32 if SMOKE else 128
    g = torch.Generator(device=DEV).manual_seed(2)
    out = []
    for n, k in shapes:
        # Weights rotate over copies that together exceed the L2 cache (60 MB on an H200)
        # several times, as a model's layers do: one matrix timed over and over is read from
        # the L2, not from memory.
        copies = 2 if SMOKE else copies_beyond_l2(n * k // 2)
        w = [torch.randn(n, k, generator=g, device=DEV).to(BF16)
             for _ in range(max(2, copies // 4))]
        w8 = [(torch.randint(-127, 128, (n, k), generator=g, device=DEV, dtype=torch.int8),
               torch.full((n,), 1e-3, dtype=BF16, device=DEV)) for _ in range(max(2, copies // 2))]
        # Scales and zero points as Int4Linear keeps them on CUDA: float32, group-major.
        w4 = [(pack_int4(torch.randint(0, 16, (n, k), generator=g, device=DEV)),
               torch.full((k // gs, n), 1e-2, device=DEV).t(),
               torch.full((k // gs, n), 8.0, device=DEV).t()) for _ in range(copies)]
        for m in ms:
            if over_budget():
                row("matmul", f"M={m} {k}->{n}", "skipped (time budget)")
                continue
            x = torch.randn(m, k, generator=g, device=DEV).to(BF16)
            t_bf16 = _time_rotating(partial(_matmul_t, x), [(wb,) for wb in w])
            t_w8 = _time_rotating(partial(w8a16_matmul, x), w8)
            t_w4 = _time_rotating(lambda *ws, x=x: w4a16_matmul(x, *ws, gs), w4)
            out.append({"m": m, "k": k, "n": n, "bf16_us": round(t_bf16 * 1e6, 1),
                        "w8a16_us": round(t_w8 * 1e6, 1), "w4a16_us": round(t_w4 * 1e6, 1),
                        "w8_speedup": round(t_bf16 / t_w8, 2),
                        "w4_speedup": round(t_bf16 / t_w4, 2)})
            row("matmul", f"M={m:<3d} {k}->{n}",
                f"bf16 {t_bf16 * 1e6:7.1f} us | w8a16 {t_w8 * 1e6:7.1f} us ({t_bf16 / t_w8:4.2f}x)"
                f" | w4a16 {t_w4 * 1e6:7.1f} us ({t_bf16 / t_w4:4.2f}x)")
    m1 = [r["w4_speedup"] for r in out if r["m"] == 1]
    return {"runs": out, "target_int4_m1_ge_2.5x": (min(m1) >= 2.5) if m1 else None}


# ---- 4b. MoE experts: fused_moe vs one GEMM per expert -----------------------------------
def _experts_one_by_one(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """models/moe.py's loop, as the engine runs quantized or non-Triton experts."""
    from argosy_kernels.silu_and_mul import silu_and_mul

    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = _matmul_t(silu_and_mul(_matmul_t(x[tokens], w13[e])), w2[e])
        out.index_add_(0, tokens, (h * weights[tokens, slots].unsqueeze(-1)).to(x.dtype))
    return out


@section("moe")
def moe_section() -> dict:
    """Mixtral-8x7B's expert shapes (8 experts, hidden 4096, 14336 each, top 2): fused_moe
    against its reference, then timed against the per-expert loop; GB/s counts the weights
    of the experts the batch routes to."""
    from argosy_kernels.fused_moe import fused_moe, fused_moe_ref

    experts, top_k = 8, 2
    g = torch.Generator(device=DEV).manual_seed(3)
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=g, device=DEV) * HIDDEN**-0.5
           ).to(BF16)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=g, device=DEV) * INTER**-0.5).to(BF16)
    copy_gbps = RESULTS.get("copy_gbps") or float("nan")
    out = []
    for m in ((1, 16) if SMOKE else (1, 16, 64, 256)):
        if over_budget():
            row("moe", f"M={m}", "skipped (time budget)")
            continue
        x = torch.randn(m, HIDDEN, generator=g, device=DEV).to(BF16)
        probs = torch.randn(m, experts, generator=g, device=DEV).softmax(-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        err = _max_rel(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
        t_fused = time_fn(partial(fused_moe, x, w13, w2, weights, ids))
        t_loop = time_fn(partial(_experts_one_by_one, x, w13, w2, weights, ids), capture=False)
        used = int(torch.unique(ids).numel())
        gbps = used * 3 * INTER * HIDDEN * 2 / t_fused / 1e9
        out.append({"m": m, "experts_used": used, "max_rel_err": err,
                    "fused_us": round(t_fused * 1e6, 1), "loop_us": round(t_loop * 1e6, 1),
                    "speedup": round(t_loop / t_fused, 2), "gbps": round(gbps, 1),
                    "frac_of_copy": round(gbps / copy_gbps, 3)})
        row("moe", f"M={m:<3d} {used} experts",
            f"fused {t_fused * 1e6:8.1f} us ({gbps:5.0f} GB/s, {100 * gbps / copy_gbps:4.1f}% of "
            f"copy) | loop {t_loop * 1e6:8.1f} us ({t_loop / t_fused:4.2f}x) | err {err:.1e}")
    return {"runs": out}


# ---- 5. engine: Triton vs torch attention, greedy, float32 --------------------------------
# The last prompt spans several KV blocks, so prefill reads paged context too. Smoke: one
# prompt, a few tokens, on the CPU under the interpreter (slow, but the path).
ENGINE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
                  "List three colors:",
                  "Kubernetes schedules pods onto nodes. A deployment keeps a number of replicas "
                  "running, a service gives them one address, and an operator reconciles "
                  "custom resources into such objects. Explain, step by step, what happens "
                  "when a user applies a manifest that asks for three replicas of a model "
                  "server:"][: 1 if SMOKE else None]


ENGINE_REFERENCE: list[Any] = []  # the engine section's torch-path outputs


def _engine_params() -> Any:
    from argosy_runtime import SamplingParams

    # prompt_logprobs: every prompt token's logprob depends on attention over its context,
    # so the paths are compared on numbers, not only on argmaxes.
    return SamplingParams(temperature=0.0, max_tokens=3 if SMOKE else 48, ignore_eos=True,
                          logprobs=0, prompt_logprobs=0)


def _logprobs(outputs: list[Any]) -> list[float]:
    """Each request's prompt and generated tokens' logprobs, in order, one flat list."""
    flat: list[float] = []
    for o in outputs:
        ids = [*o.prompt_token_ids[1:], *o.outputs[0].token_ids]
        positions = [*o.prompt_logprobs[1:], *o.outputs[0].logprobs]
        flat += [pos[tok].logprob for tok, pos in zip(ids, positions, strict=True)]
    return flat


@section("engine")
def engine_section() -> dict:
    from argosy_runtime import LLM
    from argosy_runtime.attention.torch_backend import TorchAttentionBackend
    from argosy_runtime.attention.triton_backend import TritonAttentionBackend

    prompts, params = ENGINE_PROMPTS, _engine_params()
    # A small KV cache: by default it would take most of the GPU, and the next section
    # needs the memory for an 8B model.
    llm = LLM(model=ARGS.model, dtype="float32", device=DEV.type, enforce_eager=True,
              kv_cache_memory=1 << 30)
    runner = llm.engine.runner
    dims = (runner.backend.num_heads, runner.backend.num_kv_heads, runner.backend.head_dim,
            runner.backend.scale)
    # The engine picks the Triton path on CUDA by itself: set each path explicitly (attention
    # backend, and the model's norms and rotary), torch first.
    model = llm.engine.model
    runner.backend = TorchAttentionBackend(*dims)
    model.use_triton_ops(False)
    torch_res = llm.generate(prompts, params)
    backends, layer_ops = [type(runner.backend).__name__], [model.ops]
    runner.backend = TritonAttentionBackend(*dims)
    model.use_triton_ops()
    triton_res = llm.generate(prompts, params)
    backends.append(type(runner.backend).__name__)
    layer_ops.append(model.ops)
    same, diff = _compare(torch_res, triton_res)
    row("engine", f"greedy tokens, torch vs Triton (fp32, {ARGS.model})",
        f"{sum(same)}/{len(same)} identical")
    row("engine", "max |logprob torch - Triton|", f"{diff:.2e} (<= 1e-03)")
    del llm, model, runner
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    ENGINE_REFERENCE[:] = torch_res  # for the next section
    return {"model": ARGS.model, "identical": all(same), "per_prompt": same,
            "max_logprob_diff": diff, "logprobs_ok": diff <= 1e-3, "backends": backends,
            "layer_ops": layer_ops}


@section("engine_graphs")
def engine_graphs_section() -> dict:
    """The engine as served on CUDA (its own kernel choice, decode steps replayed from CUDA
    graphs, batches padded to a captured size) against the engine section's torch path."""
    from argosy_runtime import LLM

    torch_res = list(ENGINE_REFERENCE)
    if DEV.type != "cuda" or not torch_res:
        return {"skipped": "needs CUDA and the engine section's outputs"}
    llm = LLM(model=ARGS.model, dtype="float32", device="cuda", kv_cache_memory=1 << 30)
    graphs = llm.engine.runner.graph_runner is not None
    same, diff = _compare(torch_res, llm.generate(ENGINE_PROMPTS, _engine_params()))
    row("engine_graphs", "greedy tokens, torch vs engine with CUDA graphs",
        f"{sum(same)}/{len(same)} identical, max |logprob diff| {diff:.2e}"
        f"{'' if graphs else ' (NO graphs captured)'}")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"captured": graphs, "identical": all(same), "per_prompt": same,
            "max_logprob_diff": diff, "logprobs_ok": diff <= 1e-3}


def _compare(ref: list[Any], got: list[Any]) -> tuple[list[bool], float]:
    """Per request, whether the greedy tokens are the same; and the largest logprob
    difference over the requests whose tokens are the same (every prompt and output token)."""
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids
            for a, b in zip(ref, got, strict=True)]
    pairs = [(a, b) for a, b, s in zip(ref, got, same, strict=True) if s]
    diff = max((abs(x - y) for x, y in zip(_logprobs([a for a, _ in pairs]),
                                         _logprobs([b for _, b in pairs]), strict=True)),
               default=float("nan"))
    return same, diff


# ---- 6. end-to-end decode --------------------------------------------------------------------
def _llama3_8b_spec(smoke: bool) -> Any:
    from argosy_runtime.model_loader.model_spec import ModelSpec

    if smoke:
        dims = {"vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": INTER,
                "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KVH,
                "head_dim": D}
    else:
        dims = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128}
    return ModelSpec(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False,
                     attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
                     checkpoint_dtype="bfloat16", **dims)


def _quantize_linears(model: Any, kind: str) -> None:
    """Swap every decoder Linear for a random Int8Linear / Int4Linear (runtime classes), built
    straight on the device in the CUDA kernels' layout."""
    from argosy_kernels.w4a16_matmul import pack_int4
    from argosy_runtime.quantization.int4_linear import Int4Linear
    from argosy_runtime.quantization.int8_linear import Int8Linear

    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            n, k = old.out_features, old.in_features
            if kind == "int8":
                new = Int8Linear(k, n, dtype=BF16, device=DEV)
                new.qweight.copy_(torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8))
                new.scales.fill_(0.02 / 127)
            else:
                gs = 32 if SMOKE else 128
                new = Int4Linear(k, n, gs, dtype=BF16)
                np_, ng = new.padded_out_features, new.num_groups
                new.qweight = pack_int4(torch.randint(0, 16, (np_, new.padded_in_features),
                                                      device=DEV))
                # Group-major, as Int4Linear.repack("cuda") stores them.
                new.kernel_scales = torch.full((ng, np_), 0.02 / 8, device=DEV).t()
                new.kernel_zeros = torch.full((ng, np_), 8.0, device=DEV).t()
                new.scales_and_zeros = new.scales_and_zeros.to(DEV)
                # Through _set_layout: a bare `layout = "cuda"` left the layer's CPU fast path
                # on, which hands CUDA tensors to the C++ CPU op.
                new._set_layout("cuda")
            setattr(parent, name, new)
            del old
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def _weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every parameter/buffer but the embedding table and rotary
    tables (the embedding is read by row, a few KB)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or "embed_tokens" in name or "rotary" in name or name.endswith(
                ("scales_and_zeros", "input_perm")) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@section("e2e")
def e2e_section() -> dict:
    from argosy_runtime.attention import AttentionMetadata
    from argosy_runtime.attention.triton_backend import TritonAttentionBackend
    from argosy_runtime.cuda_graph_runner import CUDAGraphRunner
    from argosy_runtime.models.llama import LlamaForCausalLM

    spec = _llama3_8b_spec(SMOKE)
    context = 64 if SMOKE else 1024
    batches = (1, 4) if SMOKE else (1, 64)
    # Weights allocated on the GPU (16 GB, no host copy); .to() moves the rotary tables.
    model = LlamaForCausalLM(spec, dtype=BF16, max_positions=context + 64, device=DEV)
    model = model.to(DEV).eval()
    model.use_triton_ops()  # as the engine does on CUDA
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if "norm" not in name else p.fill_(1.0)
    max_blocks = context // BS + 1
    num_blocks = max(batches) * max_blocks + 1
    shape = (spec.num_hidden_layers, 2, num_blocks, BS, spec.num_key_value_heads, spec.head_dim)
    kv = torch.zeros(shape, dtype=BF16, device=DEV)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(spec.num_hidden_layers)]
    backend = TritonAttentionBackend(spec.num_attention_heads, spec.num_key_value_heads,
                                     spec.head_dim, spec.head_dim**-0.5)
    copy_gbps = RESULTS.get("copy_gbps") or float("nan")
    out = []
    for kind in ("bf16", "int8", "int4"):
        if over_budget():
            row("e2e", kind, "skipped (time budget)")
            continue
        if kind != "bf16":
            _quantize_linears(model, kind)
        weights = _weight_bytes(model)
        runner = CUDAGraphRunner(model, caches, None, backend, max_blocks_per_seq=max_blocks,
                                 device=DEV, max_batch_size=max(batches), buckets=batches)
        runner.capture()
        for b in batches:
            tables = torch.arange(1, 1 + b * max_blocks, dtype=torch.int32,
                                  device=DEV).view(b, max_blocks)
            pos = torch.full((b,), context - 1, dtype=torch.long, device=DEV)
            slots = tables[:, (context - 1) // BS].long() * BS + (context - 1) % BS
            meta = AttentionMetadata(
                slot_mapping=slots, num_decodes=b, decode_block_tables=tables,
                decode_context_lens=torch.full((b,), context, dtype=torch.int32, device=DEV),
                prefill_query_lens=[], prefill_seq_lens=[], prefill_block_tables=tables[:0])
            ids = torch.zeros(b, dtype=torch.long, device=DEV)

            def step(runner: CUDAGraphRunner = runner, ids: torch.Tensor = ids,
                     pos: torch.Tensor = pos, meta: AttentionMetadata = meta) -> torch.Tensor:
                hidden = runner.forward(ids, pos, meta)
                return model.compute_logits(hidden).argmax(-1)

            with torch.inference_mode():
                # step() replays the runner's own graphs: time it as is, no outer capture.
                t = time_fn(step, iters=5 if not SMOKE else 1, reps=5, capture=False)
            kv_bytes = (b * context * spec.num_hidden_layers * spec.num_key_value_heads
                        * spec.head_dim * 2 * 2)
            roofline_s = (weights + kv_bytes) / (copy_gbps * 1e9)
            frac = roofline_s / t
            out.append({"weights": kind, "batch": b, "context": context,
                        "step_ms": round(t * 1e3, 3), "tokens_per_s": round(b / t, 1),
                        "weight_gb": round(weights / 1e9, 2), "kv_gb": round(kv_bytes / 1e9, 3),
                        "roofline_ms": round(roofline_s * 1e3, 3), "frac_of_roofline": round(frac, 3)})
            row("e2e", f"{kind} batch={b:<3d} ctx={context}",
                f"{t * 1e3:7.2f} ms/step {b / t:8.0f} tok/s  roofline {roofline_s * 1e3:6.2f} ms"
                f" ({100 * frac:4.1f}%)")
        runner = None  # free its graphs before the next variant
    target = [r for r in out if r["batch"] == 1]
    return {"runs": out,
            "target_batch1_ge_60pct_roofline": all(r["frac_of_roofline"] >= 0.6 for r in target)
            if target else None}


def _write_results() -> None:
    RESULTS["total_seconds"] = round(elapsed(), 1)
    with open(ARGS.out, "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)


def main() -> int:
    if not SMOKE and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False), so "
              "nothing was measured. Run this on a machine with an NVIDIA GPU, e.g. one "
              "H100/H200: python bench/gpu_check.py --out docs/benchmarks/gpu_check.json",
              file=sys.stderr)
        return 2
    if SMOKE:
        print("gpu_check --smoke: toy shapes on the CPU under the Triton interpreter; the "
              "numbers below check the script, they are not measurements.")
    RESULTS["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for run in (device_section, correctness_section, decode_attention_section, matmul_section,
                moe_section, engine_section, engine_graphs_section, e2e_section):
        run()
        _write_results()  # after every section: a run cut short keeps what it measured
    print("\n== gpu_check summary" + (" (SMOKE: not measurements)" if SMOKE else "") + " ==")
    width = max((len(i) for _, i, _ in ROWS), default=10)
    for sec, item, value in ROWS:
        print(f"{sec:17s} {item:{width}s} {value}")
    print(f"wrote {ARGS.out} ({RESULTS['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
