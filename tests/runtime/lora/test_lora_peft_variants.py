"""PEFT adapters beyond plain LoRA on a text model: each one is served as PEFT applies it, or
refused naming why, never loaded to answer differently. Real adapters saved by PEFT.

- aLoRA (`alora_invocation_tokens`) applies only from its invocation tokens on;
- `lora_bias` adds a bias to lora_B;
- a multimodal Gemma 3 (Gemma3ForConditionalGeneration, gemma-3-4b/12b/27b-it) adapter also
  holds its image encoder's q/k/v LoRA (`...vision_tower.encoder.layers.0.self_attn.k_proj`):
  the server runs the text model only, so those are skipped, as the base loader skips the
  tower's weights; they used to land on the text layer of the same index."""

from __future__ import annotations

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
    assert_no_leaks,
    greedy,
    random_prompts,
    run_requests,
)
from model_factory import (  # noqa: E402
    embedded_tokenizer_files,
    make_peft_adapter,
    make_random_model_dir,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


@pytest.mark.parametrize("config, setting", [
    (dict(alora_invocation_tokens=[5, 100]), "alora_invocation_tokens"),
    (dict(lora_bias=True), "lora_bias"),
])
def test_adapters_peft_applies_otherwise_are_refused(llama_dir, tmp_path, config,  # noqa: ANN001
                                                     setting) -> None:
    """Refused at loading and at lazy registration (--max-loaded-loras), not served as a
    plain LoRA on every token (aLoRA loaded without complaint before)."""
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"], **config)
    spec = load_checkpoint(str(llama_dir)).spec
    message = f"^LoRA adapter 'a': unsupported adapter_config.json setting.*{setting}"
    with pytest.raises(ValueError, match=message):
        LoRAAdapter.load("a", folder, spec, torch.float32)
    with pytest.raises(ValueError, match=message):
        check_registrable("a", str(folder))


def _multimodal_gemma3(tmp_path: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration folder whose SigLIP tower's k/v projections have
    the text model's shapes (hidden 64 -> 64), so a tower LoRA fits a text layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = make_random_model_dir(tmp_path, "gemma3", num_hidden_layers=2, head_dim=32,
                                 tie_word_embeddings=True, init_std=0.15, rms_norm_eps=1e-6)
    text_config = load_checkpoint(str(text)).spec  # checks the folder serves
    assert (text_config.hidden_size, text_config.num_key_value_heads) == (64, 2)
    import json

    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=json.loads((text / "config.json").read_text()),
                          vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(str(text), dtype=torch.float32)
    model.model.language_model.load_state_dict(causal.model.state_dict())
    folder = tmp_path / "gemma3-multimodal"
    model.save_pretrained(folder)
    for name, content in embedded_tokenizer_files().items():
        (folder / name).write_bytes(content)
    return folder


def test_multimodal_gemma3_adapter_serves_its_text_part(tmp_path) -> None:  # noqa: ANN001
    """PEFT targets the tower's k_proj/v_proj beside the text model's: served, the adapter
    equals PEFT on text prompts (the tower's LoRA, which used to replace layer 0's, plays no
    part there)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from transformers import Gemma3ForConditionalGeneration

    folder = _multimodal_gemma3(tmp_path)
    torch.manual_seed(3)
    base = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                    target_modules=["k_proj", "v_proj"])).save_pretrained(
        str(adapter))
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert any(".vision_tower." in key for key in f.keys())
    peft = PeftModel.from_pretrained(
        Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32),
        str(adapter)).eval()
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4,
                       lora_modules={"a": str(adapter)})
    assert sorted(engine.lora_adapters["a"].layers) == [0, 1]
    prompt = random_prompts(11, (13,))[0]
    on_adapter, on_base = run_requests(engine, [(prompt, greedy(10))] * 2, ["a", None])
    expected = FullForwardReference(peft).greedy(prompt, 10)[0]
    with peft.disable_adapter():
        base_tokens = FullForwardReference(peft).greedy(prompt, 10)[0]
    assert expected != base_tokens  # the adapter matters
    assert on_adapter.outputs[0].token_ids == expected
    assert on_base.outputs[0].token_ids == base_tokens
    assert_no_leaks(engine)


def test_image_encoder_lora_on_a_text_model_is_refused(llama_dir, tmp_path) -> None:  # noqa: ANN001
    """Elsewhere a tower's key is refused: it would land on the text layer of its index."""
    from safetensors.torch import load_file, save_file

    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["k_proj"])
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors.update({k.replace("model.model.layers", "model.vision_tower.encoder.layers"): v.clone()
                    for k, v in tensors.items()})
    save_file(tensors, str(path))
    spec = load_checkpoint(str(llama_dir)).spec
    with pytest.raises(ValueError, match="^LoRA adapter 'a': cannot apply .*vision_tower.*"
                                         "image encoder"):
        LoRAAdapter.load("a", folder, spec, torch.float32)


def test_two_keys_for_one_weight_are_refused(llama_dir, tmp_path) -> None:  # noqa: ANN001
    """`x.lora_A.weight` and `x.lora_A.default.weight` both: which one wins was arbitrary."""
    from safetensors.torch import load_file, save_file

    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["k_proj"])
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors.update({k.replace(".weight", ".default.weight"): torch.zeros_like(v)
                    for k, v in tensors.items() if "layers.1." in k})
    save_file(tensors, str(path))
    spec = load_checkpoint(str(llama_dir)).spec
    with pytest.raises(ValueError, match="^LoRA adapter 'a': layer 1 k_proj lora_[AB] appears "
                                         "twice"):
        LoRAAdapter.load("a", folder, spec, torch.float32)
