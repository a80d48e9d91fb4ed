"""GPTQ / AWQ checkpoints written here from a random model load, stay int4, and match the
exact dequantized reference; malformed ones fail at load with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.models import LlamaForCausalLM
from argosy_runtime.quantization import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizationConfig,
    detect_prequantized,
    load_quantized_weights,
)
from model_factory import make_random_model_dir
from prequant_factory import load_prequantized, reference_weights, write_quantized

GROUP = 32



CASES = [
    ("gptq", {"checkpoint_format": "gptq"}),
    ("gptq", {"checkpoint_format": "gptq_v2"}),
    ("gptq", {"act_order": True}),
    ("awq", {}),
]


@pytest.mark.parametrize(("method", "kwargs"), CASES, ids=["gptq-v1", "gptq-v2", "gptq-act-order", "awq"])
def test_prequantized_matches_dequantized_reference(float_dir: Path, tmp_path: Path, method: str,
                                                    kwargs: dict) -> None:
    qdir, ref_dir = write_quantized(float_dir, tmp_path / method, method, GROUP, **kwargs)
    detected = detect_prequantized(load_checkpoint(str(qdir)))
    assert detected == QuantizationConfig("int4", GROUP, source=method)
    model = load_prequantized(qdir)
    ref = reference_weights(ref_dir)
    params = dict(model.named_parameters())
    torch.manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        for name, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj),
                             ("self_attn.o_proj", layer.self_attn.o_proj),
                             ("mlp.gate_up_proj", layer.mlp.gate_up_proj),
                             ("mlp.down_proj", layer.mlp.down_proj)):
            full = f"model.layers.{i}.{name}"
            assert isinstance(module, Int4Linear), full
            assert f"{full}.weight" not in params  # no float copy kept
            w_ref = ref[f"{full}.weight"]
            assert (module.input_perm is not None) == bool(kwargs.get("act_order"))
            w = module.dequantize()
            if module.input_perm is not None:
                w_ref_perm = w_ref[:, module.input_perm]
                assert torch.allclose(w, w_ref_perm, atol=1e-6), full
            else:
                assert torch.allclose(w, w_ref, atol=1e-6), full
            x = torch.randn(5, module.in_features)
            expected = x @ w_ref.t()
            if module.bias is not None:
                assert torch.equal(module.bias, ref[f"{full}.bias"])
                expected = expected + ref[f"{full}.bias"]
            assert torch.allclose(module(x), expected, atol=1e-4), full
    # the lm_head is int8 per output channel; everything else loaded unquantized
    _assert_int8_head(model, ref)
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(params[name], ref[name])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_load_time_quantization_makes_the_lm_head_int8(tmp_path: Path, method: str, tied: bool) -> None:
    folder = make_random_model_dir(tmp_path, tie_word_embeddings=tied, init_std=0.1)
    model = load_prequantized(folder, QuantizationConfig(method, GROUP))
    _assert_int8_head(model, reference_weights(folder))


def _assert_int8_head(model: LlamaForCausalLM, ref: dict[str, torch.Tensor]) -> None:
    head = model.lm_head
    assert isinstance(head, Int8Linear)
    w_ref = ref.get("lm_head.weight", ref["model.embed_tokens.weight"])
    w = head.dequantize().float()
    assert ((w - w_ref).norm() / w_ref.norm()) < 0.01
    embed = model.model.embed_tokens
    ids = torch.tensor([0, 3, 7])
    if "lm_head.weight" in ref:  # untied: the embedding keeps its own float table
        assert torch.equal(embed.weight, ref["model.embed_tokens.weight"])
    else:  # tied: its rows are the int8 head's rows
        assert isinstance(embed, Int8Embedding)
        assert torch.equal(embed(ids), head.dequantize()[ids])


@pytest.mark.slow
def test_gptq_checkpoint_generates_like_its_reference(float_dir: Path, tmp_path: Path) -> None:
    """Through the engine: greedy tokens of the GPTQ folder == those of the float reference."""
    from argosy_runtime import LLM, SamplingParams

    qdir, ref_dir = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "Quantized weights"]
    outs = {}
    for label, folder in (("gptq", qdir), ("ref", ref_dir)):
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20)
        if label == "gptq":
            assert llm.engine.quantization == "int4"
        outs[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["gptq"] == outs["ref"]


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def test_group_size_mismatch_fails_clearly(float_dir: Path, tmp_path: Path) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP)
    _edit_config(qdir, group_size=64)  # tensors were written with 32
    with pytest.raises(ValueError, match=r"qzeros has shape .* expected .*does not match"):
        load_prequantized(qdir)


def test_layout_mismatch_fails_clearly(float_dir: Path, tmp_path: Path) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "awq", "awq", GROUP)
    _edit_config(qdir, quant_method="gptq", checkpoint_format="gptq")  # AWQ tensors, GPTQ config
    with pytest.raises(ValueError, match=r"qweight has shape"):
        load_prequantized(qdir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"bits": 8}, "bits=8 are not supported"),
        ({"group_size": -1}, "group_size=-1 is not supported"),
        ({"quant_method": "awq", "version": "gemv"}, "version 'gemv' is not supported"),
    ],
)
def test_unsupported_quantization_config(float_dir: Path, tmp_path: Path, changes: dict,
                                         message: str) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP)
    _edit_config(qdir, **changes)
    with pytest.raises(ValueError, match=message):
        detect_prequantized(load_checkpoint(str(qdir)))


def test_asking_another_method_of_a_prequantized_checkpoint_fails(float_dir: Path,
                                                                   tmp_path: Path) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "awq", "awq", GROUP)
    with pytest.raises(ValueError, match="pre-quantized as int4-g32 \\(awq\\)"):
        load_prequantized(qdir, QuantizationConfig("int8"))


def test_rtn_on_a_float_checkpoint_and_missing_config(float_dir: Path) -> None:
    ckpt = load_checkpoint(str(float_dir))
    assert detect_prequantized(ckpt) is None
    model = LlamaForCausalLM(ckpt.spec, torch.float32)
    with pytest.raises(ValueError, match="needs a QuantizationConfig"):
        load_quantized_weights(model, ckpt, None)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_headless_prequantized_checkpoint(tmp_path: Path, method: str) -> None:
    # An embedding model quantized as published: a bare decoder (`Qwen2Model`), whose tensor
    # names have no `model.` prefix, and no lm_head.
    float_dir = make_random_model_dir(tmp_path / "float", "qwen2", hidden_size=96,
                                      intermediate_size=160, num_attention_heads=3,
                                      num_key_value_heads=1, init_std=0.1, headless=True)
    qdir, ref_dir = write_quantized(float_dir, tmp_path / method, method, GROUP)
    model = load_prequantized(qdir)
    ref = reference_weights(ref_dir)
    assert model.lm_head is None
    for i, layer in enumerate(model.model.layers):
        down = layer.mlp.down_proj
        assert isinstance(down, Int4Linear)
        assert torch.allclose(down.dequantize(), ref[f"model.layers.{i}.mlp.down_proj.weight"],
                              atol=1e-6)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], ref["model.norm.weight"])


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("missing", ["self_attn.k_proj.bias", "mlp.up_proj.qweight"])
def test_incomplete_prequantized_checkpoint_fails(float_dir: Path, tmp_path: Path, method: str,
                                                  missing: str) -> None:
    # A bias of a quantized projection must be checked like any weight: left out, it would
    # stay uninitialized memory in the Int4Linear.
    from safetensors.torch import load_file, save_file

    qdir, _ = write_quantized(float_dir, tmp_path / method, method, GROUP)
    tensors = load_file(str(qdir / "model.safetensors"))
    prefix = "model.layers.1." + missing.rsplit(".", 1)[0]
    for key in [k for k in tensors if k.startswith(prefix + ".") and
                (k.endswith(".bias") or not missing.endswith(".bias"))]:
        del tensors[key]
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.(self_attn\.qkv|mlp\.gate_up)_proj"):
        load_prequantized(qdir)
