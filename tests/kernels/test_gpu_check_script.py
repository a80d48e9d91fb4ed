"""bench/gpu_check.py: a clear exit without a GPU; every section runs in --smoke mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_exits_with_a_clear_message_without_a_gpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr and "nothing was measured" in proc.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_matmul_tune_exits_with_a_clear_message_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_matmul_tune.py"), "--out",
                           str(tmp_path / "t.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


def test_matmul_tune_candidates_run_and_match_the_reference():
    # Every config the tuning script would time on a GPU, on small shapes under the
    # interpreter: a config the launchers reject or compute wrongly fails here, not in a lease.
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_matmul_tune as tune
    finally:
        sys.path.remove(str(BENCH))
    from argosy_kernels.w4a16_matmul import pack_int4, w4a16_matmul, w4a16_matmul_ref
    from argosy_kernels.w8a16_matmul import w8a16_matmul, w8a16_matmul_ref

    g = torch.Generator().manual_seed(0)
    k, n = 1024, 48
    qw = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    s4, z4 = torch.rand(n, k // 128, generator=g) * 0.01, torch.rand(n, k // 128, generator=g) * 15
    w8, s8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n) * 1e-3
    for m in (1, 4, 16):
        x = torch.randn(m, k, generator=g)
        for kind in ("w4", "w8"):
            for name, cfg in tune.candidates(kind, m):
                if cfg == "dense":
                    continue
                if kind == "w4":
                    got = w4a16_matmul(x, qw, s4, z4, 128, config=cfg)
                    want = w4a16_matmul_ref(x, qw, s4, z4, 128)
                else:
                    got, want = w8a16_matmul(x, w8, s8, config=cfg), w8a16_matmul_ref(x, w8, s8)
                assert float((got - want).norm() / want.norm()) < 1e-4, (kind, m, name)


@pytest.mark.slow
def test_smoke_mode_runs_every_section(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    sections = results["sections"]
    assert not [name for name, s in sections.items() if "error" in s], sections
    assert sections["correctness"]["all_ok"] is True
    assert sections["decode_attention"]["runs"] and sections["matmul"]["runs"]
    assert [r["m"] for r in sections["moe"]["runs"]] == [1, 16]
    assert all(r["max_rel_err"] < 3e-2 for r in sections["moe"]["runs"])
    # The reference run really is the torch backend (on CUDA the engine defaults to Triton).
    assert sections["engine"]["backends"] == ["TorchAttentionBackend", "TritonAttentionBackend"]
    assert sections["engine"]["layer_ops"] == ["torch", "triton"]
    assert sections["engine"]["identical"] is True
    assert sections["engine"]["logprobs_ok"] is True
    # Every weight kind through the end-to-end section (int4 was once skipped here, which hid
    # a bug that would have failed it on the GPU: the layer's CPU fast path left on).
    assert {r["weights"] for r in sections["e2e"]["runs"]} == {"bf16", "int8", "int4"}


def test_truncate_gguf_keeps_the_first_layers_byte_for_byte(tmp_path):
    import gguf
    from argosy_runtime import LLM, SamplingParams
    from argosy_runtime.model_loader.resolve import resolve_model_path

    src, _ = resolve_model_path("smollm2-135m")
    dst = tmp_path / "two.gguf"
    proc = subprocess.run([sys.executable, str(BENCH / "truncate_gguf.py"), "smollm2-135m",
                           str(dst), "--layers", "2"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    full, cut = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert int(cut.fields["llama.block_count"].contents()) == 2
    kept = {t.name: t for t in full.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 2}
    assert {t.name for t in cut.tensors} == set(kept)
    for t in cut.tensors:
        assert t.tensor_type == kept[t.name].tensor_type
        assert bytes(t.data) == bytes(kept[t.name].data), t.name
    # Every other field (tokenizer, chat template) is copied: the runtime loads and runs it.
    assert cut.fields["tokenizer.chat_template"].contents() == \
        full.fields["tokenizer.chat_template"].contents()
    llm = LLM(model=str(dst), dtype="float32")
    assert llm.engine.model.spec.num_hidden_layers == 2
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


def test_truncate_gguf_refuses_more_layers_than_the_file_has(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "truncate_gguf.py"), "smollm2-135m",
                           str(tmp_path / "x.gguf"), "--layers", "31"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "--layers must be in 1..30" in proc.stderr


def test_gpu_lease_joins_the_stashed_halves_of_the_model(tmp_path):
    # The two-call route to a lent GPU: the first call stashes one half of the GGUF on the
    # machine, the second carries the other; `run` hands gpu_check the joined file only when
    # it matches its sha256, else the 8-layer file, saying why.
    import hashlib
    import shutil

    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    shutil.copy(BENCH / "gpu_lease.sh", root / "bench")
    data = bytes(range(256)) * 37
    for folder, name, part in ((".gpu1", "smollm2.gguf.part1", data[:4000]),
                               (".gpu2", "smollm2.gguf.part2", data[4000:])):
        (root / folder).mkdir()
        (root / folder / name).write_bytes(part)
    (root / ".gpu2" / "smollm2.gguf.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    joined = tmp_path / "joined.gguf"
    env = {"PATH": "/usr/bin:/bin", "GPU_LEASE_JOINED": str(joined)}

    def lease(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(root / "bench" / "gpu_lease.sh"), *args],
                              capture_output=True, text=True, env=env, timeout=60)

    # A fresh machine: no stash yet, nothing to load.
    fresh = lease("model")
    assert fresh.stdout == "" and "fresh machine" in fresh.stderr
    assert lease("stash").returncode == 0
    assert lease("model").stdout.strip() == str(joined)
    assert joined.read_bytes() == data
    # A damaged half: not loaded; the 8-layer file instead where it was carried.
    (root / ".gpu2" / "smollm2.gguf.part2").write_bytes(data[4000:-1])
    (root / ".gpu").mkdir()
    (root / ".gpu" / "smollm2-8l.gguf").write_bytes(b"8 layers")
    damaged = lease("model")
    assert damaged.stdout.strip() == ".gpu/smollm2-8l.gguf" and "sha256" in damaged.stderr
