"""PEFT adapters beyond plain LoRA on a text model: each one is served as PEFT applies it, or
refused naming why, never loaded to answer differently. Real adapters saved by PEFT.

- aLoRA (`alora_invocation_tokens`) applies only from its invocation tokens on;
- `lora_bias` adds a bias to lora_B;
- a multimodal Gemma 3 (Gemma3ForConditionalGeneration, gemma-3-4b/12b/27b-it) adapter also
  holds its image encoder's q/k/v LoRA (`...vision_tower.encoder.layers.0.self_attn.k_proj`):
  the server runs the text model only, so those are skipped, as the base loader skips the
  tower's weights; they used to land on the text layer of the same index."""

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
    _assert_refused(llama_dir, folder, setting)


@pytest.mark.parametrize("setting, value", [
    ("kasa_config", {"truncate_svd": True}),
    ("use_bdlora", {"lora_a_is_blockdiagonal": True, "nblocks": 2}),
    ("arrow_config", {"top_k": 2}),
    ("layer_replication", [[0, 2], [1, 2]]),
    ("trainable_token_indices", [5, 6]),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
])
def test_variants_whose_factors_are_not_the_model_are_refused(llama_dir, tmp_path, setting,  # noqa: ANN001
                                                              value) -> None:
    """Settings of PEFT variants under which A and B alone do not give the trained model
    (written into a real adapter's config): they loaded as a plain LoRA, silently."""
    _assert_refused(llama_dir, _adapter_with_config(llama_dir, tmp_path, **{setting: value}),
                    setting)


def _adapter_with_config(llama_dir: Path, tmp_path: Path, **changes: object) -> Path:
    """A real PEFT adapter whose adapter_config.json then gets `changes` (settings PEFT
    cannot build here, written as PEFT saves them)."""
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"])
    config_path = folder / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    return folder


def _assert_refused(llama_dir: Path, folder: Path, setting: str) -> None:
    """Refused naming `setting`, at loading and at lazy registration (--max-loaded-loras)."""
    spec = load_checkpoint(str(llama_dir)).spec
    message = f"^LoRA adapter 'a': unsupported adapter_config.json setting.*{setting}"
    with pytest.raises(ValueError, match=message):
        LoRAAdapter.load("a", folder, spec, torch.float32)
    with pytest.raises(ValueError, match=message):
        check_registrable("a", str(folder))


@pytest.mark.parametrize("variant", ["monteclora_config", "velora_config"])
def test_training_only_variants_are_served_as_peft_evaluates_them(llama_dir, tmp_path,  # noqa: ANN001
                                                                  variant) -> None:
    """MonteCLoRA samples around lora_A and VeLoRA compresses its activations in training
    only; PEFT's eval forward is plain LoRA. Their adapters also hold that training state
    (`...lora_monteclora_sampler.std_prior`, `...lora_velora_embed`), which failed the load
    as tensors of no projection."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora.config import MontecloraConfig, VeloraConfig
    from transformers import AutoModelForCausalLM

    variant_config = {"monteclora_config": MontecloraConfig, "velora_config": VeloraConfig}
    torch.manual_seed(0)
    trained = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                   **{variant: variant_config[variant]()}))
    with torch.no_grad():
        for key, param in trained.named_parameters():
            if key.endswith(("lora_A.default.weight", "lora_B.default.weight")):
                param.add_(torch.randn_like(param) * 0.3)
    folder = tmp_path / "a"
    trained.save_pretrained(str(folder))
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32),
        str(folder)).eval()
    prompt = random_prompts(5, (12,))[0]
    expected = FullForwardReference(peft).greedy(prompt, 10)[0]
    with peft.disable_adapter():
        assert FullForwardReference(peft).greedy(prompt, 10)[0] != expected  # it matters
    engine = LLMEngine(model=str(llama_dir), dtype="float32", lora_modules={"a": str(folder)})
    (out,) = run_requests(engine, [(prompt, greedy(10))], ["a"])
    assert out.outputs[0].token_ids == expected
    assert_no_leaks(engine)


def test_a_lora_ga_adapter_is_refused_as_pissas_are(llama_dir, tmp_path) -> None:  # noqa: ANN001
    """LoRA-GA also subtracts its initial B A from the base weights (PEFT converts it with
    PiSSA's route); its name written into a real adapter's config, as PEFT saves it."""
    folder = _adapter_with_config(llama_dir, tmp_path, init_lora_weights="lora_ga")
    with pytest.raises(ValueError, match="init_lora_weights 'lora_ga': .*changed"):
        LoRAAdapter.load("a", folder, load_checkpoint(str(llama_dir)).spec, torch.float32)


def _multimodal_gemma3(tmp_path: Path) -> Path:
    """A tiny Gemma3ForConditionalGeneration folder whose SigLIP tower's k/v projections have
    the text model's shapes (hidden 64 -> 64), so a tower LoRA fits a text layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = make_random_model_dir(tmp_path, "gemma3", num_hidden_layers=2, head_dim=32,
                                 tie_word_embeddings=True, init_std=0.15, rms_norm_eps=1e-6)
    text_config = load_checkpoint(str(text)).spec  # checks the folder serves
    assert (text_config.hidden_size, text_config.num_key_value_heads) == (64, 2)

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


def _trained_adapter(model_dir: Path, out: Path, init: str, convert: bool = False) -> Path:
    """An adapter made with PEFT's `init_lora_weights=init` (PiSSA, OLoRA: they subtract their
    initial B A from the base weights), its A and B then moved as training would, saved as
    PEFT saves it (`convert`: as a plain LoRA for the unchanged base, through
    path_initial_model_for_weight_conversion, the route PEFT documents for serving)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=init,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    initial = out.parent / f"{out.name}-initial"
    if convert:
        model.save_pretrained(str(initial))  # before training, as PEFT's conversion needs
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_" in key:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(out), **(
        {"path_initial_model_for_weight_conversion": str(initial)} if convert else {}))
    return out


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_adapters_for_a_changed_base_are_refused(llama_dir, tmp_path, init) -> None:  # noqa: ANN001
    """Saved as trained (not converted), a PiSSA / OLoRA adapter's A and B apply to the base
    minus their initial B A, which PEFT recomputes when it loads the adapter: on the base
    served they gave other tokens than PEFT, silently (every shape fits). Refused, saying how
    to convert it, at loading and at lazy registration."""
    folder = _trained_adapter(llama_dir, tmp_path / "a", init)
    spec = load_checkpoint(str(llama_dir)).spec
    message = (f"^LoRA adapter 'a': adapter_config.json init_lora_weights '{init}': .*changed"
               ".*path_initial_model_for_weight_conversion")
    with pytest.raises(ValueError, match=message):
        LoRAAdapter.load("a", folder, spec, torch.float32)
    with pytest.raises(ValueError, match=message):
        check_registrable("a", str(folder))


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_converted_pissa_and_olora_adapters_equal_peft(llama_dir, tmp_path, init) -> None:  # noqa: ANN001
    """The route the refusal names works: converted (rank 2r, plain LoRA for the unchanged
    base), the adapter's tokens equal PEFT's on the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = _trained_adapter(llama_dir, tmp_path / "a", init, convert=True)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32),
        str(folder)).eval()
    engine = LLMEngine(model=str(llama_dir), dtype="float32", lora_modules={"a": str(folder)})
    prompt = random_prompts(5, (12,))[0]
    expected = FullForwardReference(peft).greedy(prompt, 10)[0]
    with peft.disable_adapter():
        assert FullForwardReference(peft).greedy(prompt, 10)[0] != expected  # it matters
    (out,) = run_requests(engine, [(prompt, greedy(10))], ["a"])
    assert out.outputs[0].token_ids == expected
    assert_no_leaks(engine)


def test_qalora_adapter_for_a_gptq_base_gets_a_clear_error(llama_dir, tmp_path) -> None:  # noqa: ANN001
    """QA-LoRA on a GPTQ base pools the input in groups before lora_A: A is [r, in / group].
    The error says so (it was a bare shape mismatch). Trained on a float base, PEFT ignores
    use_qalora (A [r, in], plain LoRA), and such an adapter still loads."""

    from safetensors.torch import load_file, save_file

    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj"], use_qalora=True, qalora_group_size=16)
    spec = load_checkpoint(str(llama_dir)).spec
    assert LoRAAdapter.load("a", folder, spec, torch.float32).layers  # the float-base case
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["use_qalora"] and config["qalora_group_size"] == 16
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    # As PEFT's QALoraLinearVariant shapes A: [r, in_features // group].
    tensors = {k: v[:, : v.shape[1] // 16].contiguous() if "lora_A" in k else v
               for k, v in tensors.items()}
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a': layer 0 q_proj: a QA-LoRA adapter "
                                         r"\(use_qalora, lora_A over inputs pooled in groups "
                                         r"of 16: A \(4, 4\)\) is not supported"):
        LoRAAdapter.load("a", folder, spec, torch.float32)
