"""Adapter settings found in real adapters, served as PEFT evaluates them (real adapters
saved by PEFT into tmp folders, compared with PEFT's own forward):

- `rank_pattern` / `alpha_pattern` (PEFT, axolotl, LLaMA-Factory write them): a per-module
  rank and alpha, matched as PEFT's `get_pattern_key` does. They were refused;
- lora_A / lora_B saved in float8: loaded as PEFT loads them (cast), not a
  NotImplementedError from the NaN check (a 500 over HTTP)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLMEngine
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.lora.registry import check_registrable
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import (  # noqa: E402
    FullForwardReference,
    assert_equals_reference,
    assert_no_leaks,
    greedy,
    random_prompts,
    run_requests,
)
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


def _peft(llama_dir: Path, folder: Path) -> FullForwardReference:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    return FullForwardReference(PeftModel.from_pretrained(base, str(folder)).eval())


@pytest.mark.parametrize("config", [
    # plain module names; a full module name; q, k, v of one layer at different ranks
    dict(target_modules=["q_proj", "v_proj", "down_proj"],
         rank_pattern={"v_proj": 2, "model.layers.1.mlp.down_proj": 6},
         alpha_pattern={"v_proj": 32}),
    # regexes, each pattern on its own modules, every projection adapted
    dict(target_modules="all-linear",
         rank_pattern={r"layers\.1\..*(q_proj|k_proj)": 8},
         alpha_pattern={r".*\.0\.self_attn\.k_proj": 3, "up_proj": 20}),
    # rsLoRA: alpha / sqrt(r) per module
    dict(target_modules=["q_proj", "k_proj", "v_proj"], use_rslora=True,
         rank_pattern={"k_proj": 2}, alpha_pattern={"q_proj": 5}),
], ids=["names", "regexes", "rslora"])
def test_rank_and_alpha_patterns_equal_peft(llama_dir: Path, tmp_path: Path,
                                            config: dict) -> None:
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8, **config)
    check_registrable("a", str(folder))  # --max-loaded-loras registers it too
    prompts = random_prompts(7, (9, 14))
    ref = _peft(llama_dir, folder)
    engine = LLMEngine(model=str(llama_dir), dtype="float32", block_size=4,
                       lora_modules={"a": str(folder)})
    outs = run_requests(engine, [(p, greedy(8)) for p in prompts], ["a", "a"])
    assert_equals_reference(outs, prompts, ref, 8)
    assert_no_leaks(engine)

    # The patterns matter: PEFT without alpha_pattern answers otherwise.
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "alpha_pattern": {}}))
    without = _peft(llama_dir, folder)
    assert any(
        (ref.greedy(p, 8)[1][i] - without.greedy(p, 8)[1][i]).abs().max() > 1e-3
        for p in prompts for i in range(8))


def test_the_bfloat16_paths_take_modules_of_other_ranks(llama_dir: Path, tmp_path: Path) -> None:
    """q, k, v of one fused projection at ranks 4, 2, 6 stack into one A [12, in]: the C++
    delta and decode layers in bf16 run it (a decode step and a prefill beside base rows)."""
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 2, r=4, lora_alpha=8,
                               target_modules=["q_proj", "k_proj", "v_proj", "gate_proj"],
                               rank_pattern={"k_proj": 2, "v_proj": 6})
    engine = LLMEngine(model=str(llama_dir), dtype="bfloat16", lora_modules={"a": str(folder)})
    adapter = engine.lora_adapters["a"]
    assert adapter.layers[0]["qkv_proj"].a.shape == (12, 64)
    prompt = random_prompts(3, (10,))[0]
    on_adapter, on_base = run_requests(engine, [(prompt, greedy(6))] * 2, ["a", None])
    assert on_adapter.outputs[0].token_ids != on_base.outputs[0].token_ids
    assert_no_leaks(engine)


@pytest.mark.parametrize("changes, message", [
    (dict(rank_pattern={"v_proj": 0}), "'rank_pattern' must map module name patterns to "
                                       "positive integers"),
    (dict(rank_pattern={"v_proj": 2.5}), "'rank_pattern' must map"),
    (dict(rank_pattern=["v_proj"]), "'rank_pattern' must map"),
    (dict(alpha_pattern={"v_proj": "16"}), "'alpha_pattern' must map module name patterns "
                                           "to numbers"),
    (dict(alpha_pattern={"(v_proj": 16}), "alpha_pattern pattern '\\(v_proj' is not a "
                                          "regular expression"),
])
def test_malformed_patterns_are_refused_naming_them(llama_dir: Path, tmp_path: Path,
                                                    changes: dict, message: str) -> None:
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"])
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    spec = load_checkpoint(str(llama_dir)).spec
    with pytest.raises(ValueError, match=f"^LoRA adapter 'a': adapter_config.json {message}"):
        LoRAAdapter.load("a", folder, spec, torch.float32)
    with pytest.raises(ValueError, match=f"^LoRA adapter 'a': adapter_config.json {message}"):
        check_registrable("a", str(folder))


def test_a_rank_pattern_the_weights_do_not_follow_is_a_shape_error(llama_dir: Path,
                                                                     tmp_path: Path) -> None:
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"])
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rank_pattern": {"v_proj": 2}}))
    with pytest.raises(ValueError, match=r"layer 0 v_proj has shapes A \(4, 64\), B \(32, 4\); "
                                         r"the model needs A \[2, 64\], B \[32, 2\]"):
        LoRAAdapter.load("a", folder, load_checkpoint(str(llama_dir)).spec, torch.float32)


def test_float8_weights_load_as_peft_casts_them(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj"])
    path = folder / "adapter_model.safetensors"
    tensors = {k: v.to(torch.float8_e4m3fn) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path))
    spec = load_checkpoint(str(llama_dir)).spec
    adapter = LoRAAdapter.load("a", folder, spec, torch.float32)
    a_key = next(k for k in tensors if "layers.0." in k and "lora_A" in k)
    assert torch.equal(adapter.layers[0]["qkv_proj"].a, tensors[a_key].float())

    tensors[a_key] = tensors[a_key].clone()
    tensors[a_key][0, 0] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="lora_A has values that are not finite"):
        LoRAAdapter.load("a", folder, spec, torch.float32)
