"""Pre-quantized GPTQ / AWQ Phi-3 folders, whose quantized tensors are stored fused
(`self_attn.qkv_proj.*`, `mlp.gate_up_proj.*`) as the Hub's Phi-3 GPTQ/AWQ exports hold them,
load exactly like the same tensors stored per projection (q/k/v, gate/up), and match the
exact dequantized reference.

The fused folder is built the way the exporters' tensors come out: a fused layer is one
linear, each output quantized on its own, so its tensors are the per-projection tensors
side by side along the output dimension (plain columns of `scales` and GPTQ's `qweight`,
int32 columns of `qzeros` and AWQ's `qweight`, eight outputs each; one shared GPTQ `g_idx`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import prequant_factory
import pytest
import torch
from argosy_runtime import LLM
from argosy_runtime.quantization import Int4Linear
from engine_helpers import greedy, random_prompts, tokens_and_logprobs
from model_factory import make_random_model_dir
from prequant_factory import load_prequantized, reference_weights, write_quantized
from safetensors.torch import load_file, save_file

GROUP = 32
# q 4 x 16 = 64 rows, k and v 2 x 16 = 32 each; gate and up 96 each.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
FUSED = {  # fused module -> its projections, in row order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
SIZES = {"self_attn.qkv_proj": [64, 32, 32], "mlp.gate_up_proj": [96, 96]}
SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-3 as transformers saves it (qkv_proj / gate_up_proj fused)."""
    return make_random_model_dir(tmp_path_factory.mktemp("float"), "phi3", name="phi3",
                                 **SHAPE)


def _unfuse_float(src: Path, dst: Path) -> Path:
    """The same model with q/k/v and gate/up stored per projection (the fused rows split)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        fused = next((f for f in FUSED if module.endswith(f)), None)
        if fused is None:
            out[name] = t
            continue
        assert leaf == "weight" and t.shape[0] == sum(SIZES[fused])
        prefix = module[: -len(fused)]
        for part, rows in zip(FUSED[fused], t.split(SIZES[fused])):
            out[f"{prefix}{part}.{leaf}"] = rows.contiguous()
    save_file(out, str(dst / "model.safetensors"))
    return dst


def _fuse_quantized(src: Path, dst: Path, method: str) -> Path:
    """The GPTQ/AWQ folder `src` (per projection) with q/k/v and gate/up stored fused, as the
    exporters write a Phi-3: every packed tensor concatenated along its output columns."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = dict(tensors)
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    for layer in sorted(layers):
        p = f"model.layers.{layer}."
        for fused, projs in FUSED.items():
            for leaf in SUFFIXES[method]:
                pieces = [out.pop(f"{p}{proj}.{leaf}") for proj in projs]
                if leaf == "g_idx":  # act-order: the projections read one input, one order
                    assert all(torch.equal(x, pieces[0]) for x in pieces)
                    out[f"{p}{fused}.{leaf}"] = pieces[0]
                else:  # GPTQ qweight [K/8, N], AWQ qweight [K, N/8], qzeros, scales: dim 1
                    out[f"{p}{fused}.{leaf}"] = torch.cat(pieces, dim=1)
            if method == "gptq":  # AutoGPTQ writes a zero bias for every layer without one
                out[f"{p}{fused}.bias"] = torch.zeros(sum(SIZES[fused]), dtype=torch.float16)
    assert not any(f".{proj}." in name for name in out for projs in FUSED.values()
                   for proj in projs)
    save_file(out, str(dst / "model.safetensors"))
    return dst


CASES = [("gptq", {}), ("gptq", {"act_order": True}), ("awq", {})]


@pytest.mark.parametrize(("method", "kwargs"), CASES, ids=["gptq", "gptq-act-order", "awq"])
def test_fused_phi3_folder_loads_like_the_unfused_one(phi3_dir: Path, tmp_path: Path,
                                                      method: str, kwargs: dict) -> None:
    unfused_float = _unfuse_float(phi3_dir, tmp_path / "phi3-unfused")
    unfused, ref_dir = write_quantized(unfused_float, tmp_path / method, method, GROUP, **kwargs)
    fused = _fuse_quantized(unfused, tmp_path / f"{method}-fused", method)

    # The loaded models: the same int4 tensors, bit for bit.
    model, model_unfused = load_prequantized(fused), load_prequantized(unfused)
    state, state_unfused = model.state_dict(), model_unfused.state_dict()
    assert state.keys() == state_unfused.keys()
    for name, value in state.items():  # tensors, and each Int4Linear's layout (_extra_state)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state_unfused[name]), name
        else:
            assert value == state_unfused[name], name

    # ... and the exact dequantized weights of the reference, as the fused layers the model
    # runs (q, k, v / gate, up rows in order: a swapped part would show here).
    ref = reference_weights(ref_dir)
    torch.manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        for name, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj),
                             ("mlp.gate_up_proj", layer.mlp.gate_up_proj)):
            full = f"model.layers.{i}.{name}"
            assert isinstance(module, Int4Linear), full
            assert (module.input_perm is not None) == bool(kwargs.get("act_order")), full
            assert module.bias is None, full  # GPTQ's zero biases were dropped
            w_ref = ref[f"{full}.weight"]
            x = torch.randn(5, module.in_features)
            assert torch.allclose(module(x), x @ w_ref.t(), atol=1e-4), full
            if module.input_perm is not None:
                w_ref = w_ref[:, module.input_perm]
            assert torch.allclose(module.dequantize(), w_ref, atol=1e-6), full
    del model, model_unfused

    # Through the engine: the same greedy tokens and logprobs, bit for bit. (Not compared
    # with the float reference here: the engine makes a quantized model's lm_head int8, which
    # moves its logits by ~1 %, enough to flip a near tie of the random model.)
    prompts = random_prompts(0, (5, 17))
    outs = {}
    for label, folder in (("fused", fused), ("unfused", unfused)):
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20)
        assert llm.engine.quantization == "int4"
        outs[label] = [tokens_and_logprobs(o) for o in llm.generate(prompts, greedy(8))]
        del llm
    assert outs["fused"] == outs["unfused"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_fused_width_not_splittable_at_int32_fails_clearly(tmp_path: Path, method: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # 2 heads of 12, 1 kv head: q 24, k 12, v 12. The fused qkv (48 outputs, 6 int32 of qzeros)
    # is quantized as one layer here, as an exporter does; k and v cannot be cut out of it.
    float_dir = make_random_model_dir(tmp_path / "float", "phi3", hidden_size=24,
                                      intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=1)
    monkeypatch.setattr(prequant_factory, "PROJS",
                        prequant_factory.PROJS + ("qkv_proj", "gate_up_proj"))
    qdir, _ = write_quantized(float_dir, tmp_path / method, method, GROUP)
    with pytest.raises(ValueError, match=r"qkv_proj: its projections' output sizes \[24, 12, 12\] "
                                         r"are not all multiples of 8"):
        load_prequantized(qdir)


def test_non_zero_fused_bias_fails_clearly(phi3_dir: Path, tmp_path: Path) -> None:
    unfused, _ = write_quantized(_unfuse_float(phi3_dir, tmp_path / "phi3-unfused"),
                                 tmp_path / "gptq", "gptq", GROUP)
    fused = _fuse_quantized(unfused, tmp_path / "gptq-fused", "gptq")
    tensors = load_file(str(fused / "model.safetensors"))
    tensors["model.layers.1.mlp.gate_up_proj.bias"][100] = 1.0  # in up's half
    save_file(tensors, str(fused / "model.safetensors"))
    with pytest.raises(ValueError, match=r"non-zero bias model\.layers\.1\.mlp\.gate_up_proj"):
        load_prequantized(fused)
