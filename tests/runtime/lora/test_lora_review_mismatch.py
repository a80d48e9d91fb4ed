"""Adapters trained on another base model are refused with a message naming the mismatch:
a vocabulary resized for added tokens (PEFT then saves the whole embeddings and LM head,
`save_embedding_layers`), or another hidden size (the base model the adapter names)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_random_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


def test_an_adapter_of_a_resized_vocabulary_names_both_vocabularies(llama_dir: Path,
                                                                     tmp_path: Path) -> None:
    """It was "cannot apply base_model.model.lm_head.weight (only the attention and MLP
    projections ...)", which does not say the adapter was trained with added tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    spec = load_checkpoint(str(llama_dir)).spec
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    base.resize_token_embeddings(spec.vocab_size + 8, mean_resizing=False)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
                   ).save_pretrained(str(tmp_path / "a"))  # PEFT saves the resized layers
    with pytest.raises(ValueError, match=(
            rf"^LoRA adapter 'a': cannot apply base_model\.model\.(lm_head|model\.embed_tokens)"
            rf"\.weight \[{spec.vocab_size + 8}, 64\]: .*whole embeddings or LM head \(a "
            rf"vocabulary of {spec.vocab_size + 8} tokens, this model's has {spec.vocab_size}")):
        LoRAAdapter.load("a", tmp_path / "a", spec, torch.float32)


def test_an_adapter_of_another_hidden_size_names_its_base_model(llama_dir: Path,
                                                                tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    other = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2, hidden_size=128)
    base = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
                   ).save_pretrained(str(tmp_path / "a"))
    with pytest.raises(ValueError, match=(
            r"^LoRA adapter 'a': layer 0 q_proj has shapes A \(4, 128\), B \(128, 4\); the "
            rf"model needs A \[4, 64\], B \[64, 4\]; it was trained on '{other}'$")):
        LoRAAdapter.load("a", tmp_path / "a", load_checkpoint(str(llama_dir)).spec,
                         torch.float32)
