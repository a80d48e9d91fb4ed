"""Compile the kernels for sm_90 (H100/H200) without a GPU: Triton's compiler plus its bundled
ptxas, at the configurations the launchers choose on a GPU, then read the cubin's resource
usage (registers, spill stack) with the bundled cuobjdump.

Run as a script (prints one JSON line per kernel); `test_sm90_compile.py` drives it in a
subprocess because the compiler path needs TRITON_INTERPRET unset when Triton is imported.

How: the launchers are run on CPU tensors with `check_device` disabled and the interpreter
switch reporting False (so they pick their GPU tile sizes); `LazyKernel.__getitem__` is
replaced by a recorder, and each recorded launch is compiled with `triton.compile` for
`GPUTarget("cuda", 90, 32)`.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from argosy_kernels import _triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
_CALLS: list[tuple[Any, tuple, dict]] = []


def _record(self: Any, grid: Any) -> Any:
    def launch(*args: Any, **kwargs: Any) -> None:
        _CALLS.append((self, args, kwargs))
    return launch


def _patch_modules() -> dict[str, Any]:
    from argosy_kernels import (
        fused_moe,
        paged_attention,
        paged_prefill_attention,
        reshape_and_cache,
        rms_norm,
        rotary_embedding,
        silu_and_mul,
        w4a16_matmul,
        w8a16_matmul,
    )
    mods = [fused_moe, paged_attention, paged_prefill_attention, reshape_and_cache, rms_norm,
            rotary_embedding, silu_and_mul, w4a16_matmul, w8a16_matmul]
    for m in mods:
        if hasattr(m, "interpret_mode"):
            m.interpret_mode = lambda: False
        if hasattr(m, "check_device"):
            m.check_device = lambda *a: None
    _triton.LazyKernel.__getitem__ = _record  # type: ignore[method-assign]
    return {m.__name__.rsplit(".", 1)[1]: m for m in mods}


def _cuobjdump(cubin: bytes, option: str) -> str:
    """The output of Triton's bundled cuobjdump `option` on `cubin`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True,
                              check=True).stdout


def _usage(cubin: bytes) -> dict[str, int]:
    out = _cuobjdump(cubin, "--dump-resource-usage")
    for line in out.splitlines():
        if "REG:" in line:
            fields = dict(p.split(":", 1) for p in line.split() if ":" in p)
            return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}
    raise RuntimeError(f"no resource usage in cuobjdump output: {out!r}")


def _compile(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Compile one recorded launch as Triton's JIT would on a GPU, specializations included:
    an int argument equal to 1 becomes a constant, and pointers and ints divisible by 16 are
    marked so (what lets the compiler emit vector loads; without it every load of an int8 or
    bf16 tile here was one element wide)."""
    kernel.fn.__globals__["tl"] = triton.language
    jitted = JITFunction(kernel.fn)
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, a) in enumerate(zip(jitted.arg_names, args, strict=False)):
        divisible = False
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + _DTYPES[a.dtype]
            divisible = a.data_ptr() % 16 == 0
        elif isinstance(a, bool):
            signature[name] = "i1"
        elif isinstance(a, int) and a == 1:
            signature[name] = "constexpr"
            kwargs[name] = 1
        elif isinstance(a, int):
            signature[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            divisible = a % 16 == 0
        else:
            signature[name] = "fp32"
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in kwargs:
        signature[name] = "constexpr"
    compiled = triton.compile(ASTSource(jitted, signature, kwargs, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    return {"kernel": kernel.__name__, "shared": compiled.metadata.shared,
            **_usage(compiled.asm["cubin"]),
            **_global_loads(compiled.asm["cubin"]),
            "config": {k: v for k, v in {**kwargs, **options}.items()
                       if k not in jitted.arg_names or k.isupper() or k.startswith("num_")}}


def _global_loads(cubin: bytes) -> dict[str, Any]:
    """Global load instructions of the cubin by width (LDG.E.U8 moves one byte,
    LDG.E.128 sixteen), and the asynchronous copies into shared memory (LDGSTS); and each
    loop (a backward branch) with its instruction count and how many of those move data
    between threads (shuffles, shared memory, barriers)."""
    sass = _cuobjdump(cubin, "--dump-sass")
    loads = collections.Counter(re.findall(r"\b(LDG\.E[.\w]*|LDGSTS[.\w]*)", sass))
    code = [(int(a, 16), op, target) for a, op, target in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(?:\s+0x([0-9a-f]+))?", sass)]
    loops = []
    for end, op, target in code:
        if op == "BRA" and target and int(target, 16) < end:
            body = [o.split(".")[0] for a, o, _ in code if int(target, 16) <= a <= end]
            loops.append({"instructions": len(body),
                          "between_threads": sum(o in ("SHFL", "BAR", "STS", "LDS", "LDSM",
                                                       "STSM") for o in body)})
    return {"loads": dict(loads), "loops": loops}


def _launch_all(m: dict[str, Any], full: bool) -> None:
    h, kvh, d, bs, nb = 32, 8, 128, 16, 64
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if full else [torch.bfloat16]
    for dt in dtypes:
        q = torch.randn(4, h, d, dtype=dt)
        kc = torch.randn(nb, bs, kvh, d, dtype=dt)
        kq = torch.zeros(nb, bs, kvh, d, dtype=torch.int8)
        ks = torch.zeros(nb, bs, kvh, dtype=torch.float16)
        bt = torch.zeros(4, 40, dtype=torch.int32)
        cl = torch.ones(4, dtype=torch.int32)
        pa = m["paged_attention"].paged_decode_attention
        pa(q, kc, kc, bt, cl, 0.1, num_splits=1)
        pa(q, kc, kc, bt, cl, 0.1, num_splits=4)
        pa(q, kq, kq, bt, cl, 0.1, k_scale=ks, v_scale=ks, num_splits=1)
        pa(q, kc, kc, bt, cl, 0.1, num_splits=4, sliding_window=4096)  # Mistral-7B v0.1's window
        pa(q, kc, kc, bt, cl, 0.1, num_splits=4, sliding_window=4096, softcap=50.0)  # Gemma 2
        qp = torch.randn(30, h, d, dtype=dt)
        qsl = torch.tensor([0, 10, 30], dtype=torch.int32)
        sl = torch.tensor([10, 40], dtype=torch.int32)
        pp = m["paged_prefill_attention"].paged_prefill_attention
        pp(qp, kc, kc, bt[:2], qsl, sl, 0.1, max_query_len=20)
        pp(qp, kq, kq, bt[:2], qsl, sl, 0.1, max_query_len=20, k_scale=ks, v_scale=ks)
        pp(qp, kc, kc, bt[:2], qsl, sl, 0.1, max_query_len=20, sliding_window=4096)
        pp(qp, kc, kc, bt[:2], qsl, sl, 0.1, max_query_len=20, sliding_window=4096, softcap=50.0)
        k = torch.randn(5, kvh, d, dtype=dt)
        rc = m["reshape_and_cache"].reshape_and_cache
        rc(k, k, kc, kc.clone(), torch.arange(5))
        rc(k, k, kq, kq.clone(), torch.arange(5), k_scale=ks, v_scale=ks.clone())
        x = torch.randn(3, 4096, dtype=dt)
        m["rms_norm"].rms_norm(x, torch.ones(4096, dtype=dt), 1e-5, x.clone())
        m["silu_and_mul"].silu_and_mul(torch.randn(3, 2 * 14336, dtype=dt))
        ro = m["rotary_embedding"]
        ro.rotary_embedding(torch.arange(3), torch.randn(3, h, d, dtype=dt),
                            torch.randn(3, kvh, d, dtype=dt), ro.build_cos_sin_cache(d, 16))
        # The model's call: q and k heads together, a strided view of the fused qkv rows.
        qkv = torch.randn(3, (h + 2 * kvh) * d, dtype=dt)
        ro.rotary_embedding(torch.arange(3), qkv[:, : (h + kvh) * d].view(3, h + kvh, d), None,
                            ro.build_cos_sin_cache(d, 16))
        # Rows: decode (1: the FMA kernels), small batches (16, 48), a larger one (100: w8a16's
        # widest tiles, w4a16's dequantize-then-cuBLAS path). The tensor-core kernels compile
        # the same at M = 1 as at 16 (M is a runtime argument). Scales as the engine keeps
        # them: w4a16's in float32, group-major (Int4Linear's kernel_scales), w8a16's in the
        # activations' dtype.
        for rows in (1, 16, 48, 100):
            xm = torch.randn(rows, 4096, dtype=dt)
            m["w8a16_matmul"].w8a16_matmul(xm, torch.zeros(4096, 4096, dtype=torch.int8),
                                           torch.ones(4096, dtype=dt))
            m["w4a16_matmul"].w4a16_matmul(xm, torch.zeros(4096, 512, dtype=torch.int32),
                                           torch.ones(32, 4096).T, torch.ones(32, 4096).T, 128)
        # Mixtral-8x7B's experts (8 of 14336, top 2) at 1 and 100 tokens (16- and 64-row
        # blocks); the expert stacks as stride-0 views (compiling needs dtypes, not bytes).
        w13 = torch.zeros(1, 2 * 14336, 4096, dtype=dt).expand(8, -1, -1)
        w2 = torch.zeros(1, 4096, 14336, dtype=dt).expand(8, -1, -1)
        for rows in (1, 100):
            ids = torch.zeros(rows, 2, dtype=torch.long)
            m["fused_moe"].fused_moe(torch.randn(rows, 4096, dtype=dt), w13, w2, ids.float(), ids)


def main() -> int:
    full = "--full" in sys.argv
    mods = _patch_modules()
    _launch_all(mods, full)
    seen: set[str] = set()
    for kernel, args, kwargs in _CALLS:
        key = json.dumps([kernel.__name__, sorted((k, str(v)) for k, v in kwargs.items()),
                          [str(getattr(a, "dtype", type(a).__name__)) for a in args]])
        if key in seen:
            continue
        seen.add(key)
        try:
            print(json.dumps(_compile(kernel, args, kwargs), default=str), flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep compiling the rest
            print(json.dumps({"kernel": kernel.__name__, "error": f"{type(e).__name__}: {e}"[-2000:],
                              "config": {k: str(v) for k, v in kwargs.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
