"""Sequence-classification HF checkpoints (`LlamaForSequenceClassification`,
`MistralForSequenceClassification`, `Qwen2ForSequenceClassification`,
`Qwen3ForSequenceClassification`: how reward models, classifiers and decoder cross-encoders
are published): the decoder (`model.*`) plus a `score` head [num_labels, hidden] and no
lm_head. They load with their labels, build a `score` linear instead of an lm_head, and the
head's logits at the last token equal transformers' own `*ForSequenceClassification`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import ModelSpec, load_checkpoint
from argosy_runtime.models.build import build_model
from argosy_runtime.models.llama import LlamaForCausalLM
from argosy_runtime.quantization import Int8Linear, QuantizationConfig
from model_factory import QWEN3_TEST_SHAPE, make_random_model_dir
from paged_forward import forward_prompt
from safetensors.torch import load_file, save_file
from torch import nn

CPU = torch.device("cpu")
MAX_POSITIONS = 256
PROMPT = [1, 504, 3458, 314, 4649, 315, 260, 1789, 3666, 30, 4483, 17, 9015, 2, 77, 41, 88,
          12000, 49151, 5]  # 20 tokens: two KV blocks
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = QWEN3_TEST_SHAPE if request.param == "qwen3" else {}
    return make_random_model_dir(tmp_path_factory.mktemp("cls"), request.param, num_labels=3,
                                 id2label=LABELS, **shape)


def _last_row_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """The head at the prompt's last row, after our paged forward: [num_labels]."""
    with torch.inference_mode():
        return model.compute_class_logits(forward_prompt(model, token_ids)[-1:])[0]


def test_spec_labels_and_a_score_head_instead_of_lm_head(classifier_dir: Path) -> None:
    config = json.loads((classifier_dir / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    ckpt = load_checkpoint(classifier_dir)
    spec = ckpt.spec
    assert spec.architecture == config["model_type"]
    assert spec.has_lm_head is False and spec.tie_word_embeddings is False
    assert spec.id2label == ("negative", "neutral", "positive") and spec.num_labels == 3
    weights = dict(ckpt.iter_weights())
    assert "lm_head.weight" not in weights
    assert weights["score.weight"].shape == (3, spec.hidden_size)
    model = build_model(ckpt, torch.float32, CPU, MAX_POSITIONS)
    assert model.lm_head is None
    assert isinstance(model.score, nn.Linear) and model.score.weight.shape == (3, spec.hidden_size)
    torch.testing.assert_close(model.score.weight, weights["score.weight"], atol=0, rtol=0)


def test_last_token_logits_match_transformers(classifier_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = build_model(load_checkpoint(classifier_dir), torch.float32, CPU, MAX_POSITIONS)
    reference = AutoModelForSequenceClassification.from_pretrained(
        str(classifier_dir), dtype=torch.float32).eval()
    assert type(reference).__name__.endswith("ForSequenceClassification")
    for prompt in (PROMPT, PROMPT[:1], PROMPT[:7]):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0]  # [num_labels]
        got = _last_row_logits(model, prompt)
        assert got.abs().max() > 0.1  # a real signal, not all zeros
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_generation_head_calls_refuse_clearly(classifier_dir: Path) -> None:
    model = build_model(load_checkpoint(classifier_dir), torch.float32, CPU, MAX_POSITIONS)
    with pytest.raises(RuntimeError, match=r"classification head, not a language-model head"):
        model.compute_logits(torch.zeros(1, model.spec.hidden_size))


def test_int8_leaves_the_score_head_in_float(classifier_dir: Path) -> None:
    """The head is num_labels x hidden (tiny): quantizing it would save nothing and cost
    accuracy, so int8 quantizes the decoder linears and keeps `score` a float nn.Linear."""
    ckpt = load_checkpoint(classifier_dir)
    want = _last_row_logits(build_model(ckpt, torch.float32, CPU, MAX_POSITIONS), PROMPT)
    model = build_model(ckpt, torch.float32, CPU, MAX_POSITIONS, QuantizationConfig("int8"))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert type(model.score) is nn.Linear and model.lm_head is None
    torch.testing.assert_close(model.score.weight, ckpt.state_dict()["score.weight"])
    got = _last_row_logits(model, PROMPT)
    # int8 decoder weights on a random model with a large init scale: close, not equal.
    assert nn.functional.cosine_similarity(got, want, dim=0) > 0.95, (got, want)


def test_default_and_single_labels(tmp_path: Path) -> None:
    # transformers writes no id2label for its default two classes, and LABEL_0 for one.
    two = make_random_model_dir(tmp_path, "llama", name="two", num_hidden_layers=1, num_labels=2)
    config = json.loads((two / "config.json").read_text())
    config.pop("id2label", None)
    config.pop("label2id", None)
    (two / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(two).spec.id2label == ("LABEL_0", "LABEL_1")
    one = make_random_model_dir(tmp_path, "qwen2", name="one", num_hidden_layers=1, num_labels=1)
    spec = load_checkpoint(one).spec
    assert spec.id2label == ("LABEL_0",) and spec.num_labels == 1


def test_broken_classifiers_name_the_problem(tmp_path: Path) -> None:
    folder = make_random_model_dir(tmp_path, "llama", name="broken", num_hidden_layers=1,
                                   num_labels=3, id2label=LABELS)
    path = folder / "model.safetensors"
    state = load_file(str(path))
    score = state.pop("score.weight")
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights.*score\.weight"):
        list(load_checkpoint(folder).iter_weights())
    state["score.weight"] = score[:2]  # 2 rows, config says 3 labels
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"shape mismatch for score\.weight"):
        build_model(load_checkpoint(folder), torch.float32, CPU, MAX_POSITIONS)
    state["score.weight"] = score
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor 'lm_head.weight' for a sequence-class"):
        list(load_checkpoint(folder).iter_weights())
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "a", "2": "c"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"id2label must number the classes 0\.\.1"):
        load_checkpoint(folder)


def test_a_spec_cannot_have_both_heads() -> None:
    fields = dict(
        architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(2,),
        checkpoint_dtype="float32",
    )
    assert ModelSpec(**fields, has_lm_head=False, id2label=("a", "b")).num_labels == 2
    assert ModelSpec(**fields).num_labels == 0
    with pytest.raises(ValueError, match="id2label .* replaces the lm_head"):
        ModelSpec(**fields, has_lm_head=True, id2label=("a",))


def test_causal_lm_and_headless_checkpoints_have_no_score_head(
        random_llama_dir: Path, tmp_path: Path) -> None:
    model = build_model(load_checkpoint(random_llama_dir), torch.float32, CPU, MAX_POSITIONS)
    assert model.score is None and model.spec.num_labels == 0
    with pytest.raises(RuntimeError, match="no classification head"):
        model.compute_class_logits(torch.zeros(1, model.spec.hidden_size))
    headless = make_random_model_dir(tmp_path, "mistral", num_hidden_layers=1, headless=True)
    assert load_checkpoint(headless).spec.id2label == ()

