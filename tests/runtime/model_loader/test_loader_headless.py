"""Headless HF checkpoints (`LlamaModel`, `MistralModel`, `Qwen2Model`: how decoder-based
embedding models such as e5-mistral-7b-instruct are published): no lm_head, weight names
without the `model.` prefix. They load, build without a head, and their hidden states (after
the final norm: what an embedding is pooled from) match transformers'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from argosy_kernels import cpu_ops
from argosy_runtime.model_loader import ModelSpec, load_checkpoint
from argosy_runtime.models.build import build_model
from argosy_runtime.models.llama import LlamaForCausalLM
from argosy_runtime.quantization import Int8Linear, QuantizationConfig
from model_factory import make_random_model_dir
from paged_forward import forward_prompt
from safetensors.torch import load_file, save_file
from torch import nn

CPU = torch.device("cpu")
MAX_POSITIONS = 256
PROMPT = [1, 504, 3458, 314, 4649, 315, 260, 1789, 3666, 30, 4483, 17, 9015, 2, 77, 41, 88,
          12000, 49151, 5]  # 20 tokens: two KV blocks


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def headless_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The qwen2 config also says tie_word_embeddings: true, as some published embedding
    # models' configs do: without a head there is nothing to tie, and loading must not care.
    return make_random_model_dir(tmp_path_factory.mktemp("headless"), request.param,
                                 headless=True, tie_word_embeddings=request.param == "qwen2")


def _hidden_states(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Our paged forward over one whole prompt: [num_tokens, hidden] float32."""
    return forward_prompt(model, token_ids).float()


def _assert_close_embeddings(got: torch.Tensor, want: torch.Tensor) -> None:
    """Loose: int8 weights against float. The random models' large init scale amplifies the
    quantization error (single tokens measured down to 0.94 cosine), so each token's hidden
    state must point the same way roughly and the mean-pooled embedding closely (>= 0.998
    measured)."""
    per_token = nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    pooled = nn.functional.cosine_similarity(got.float().mean(0), want.float().mean(0), dim=0)
    assert per_token.min() > 0.9 and pooled > 0.99, (per_token, pooled)


def test_headless_spec_and_model_have_no_head(headless_dir: Path) -> None:
    config = json.loads((headless_dir / "config.json").read_text())
    assert config["architectures"][0].endswith("Model")
    ckpt = load_checkpoint(headless_dir)
    assert ckpt.spec.has_lm_head is False
    assert ckpt.spec.tie_word_embeddings is False  # whatever the config says
    assert ckpt.spec.architecture == config["model_type"]
    weights = dict(ckpt.iter_weights())
    assert "lm_head.weight" not in weights
    assert all(name.startswith("model.") for name in weights)  # the names the model expects
    model = build_model(ckpt, torch.float32, CPU, MAX_POSITIONS)
    assert model.lm_head is None


def test_hidden_states_match_transformers(headless_dir: Path) -> None:
    from transformers import AutoModel

    model = build_model(load_checkpoint(headless_dir), torch.float32, CPU, MAX_POSITIONS)
    reference = AutoModel.from_pretrained(str(headless_dir), dtype=torch.float32).eval()
    assert type(reference).__name__.endswith("Model")  # the headless class, no lm_head
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).last_hidden_state[0]
    torch.testing.assert_close(_hidden_states(model, PROMPT), want, atol=1e-4, rtol=1e-4)


def test_compute_logits_refuses_clearly(headless_dir: Path) -> None:
    model = build_model(load_checkpoint(headless_dir), torch.float32, CPU, MAX_POSITIONS)
    with pytest.raises(RuntimeError, match=r"no language-model head .*embeddings only"):
        model.compute_logits(torch.zeros(1, model.spec.hidden_size))


def test_int8_headless_model_is_close_to_float(headless_dir: Path) -> None:
    ckpt = load_checkpoint(headless_dir)
    want = _hidden_states(build_model(ckpt, torch.float32, CPU, MAX_POSITIONS), PROMPT)
    model = build_model(ckpt, torch.float32, CPU, MAX_POSITIONS, QuantizationConfig("int8"))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert model.lm_head is None
    assert type(model.model.embed_tokens) is nn.Embedding  # no head to share an int8 table with
    _assert_close_embeddings(_hidden_states(model, PROMPT), want)


class _CountingDecodeLayers:
    """Wraps a model's CpuDecodeLayers, counting the steps that take the C++ path."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def applies(self, *args: object) -> bool:
        return self.inner.applies(*args)

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args)


@pytest.mark.skipif(not cpu_ops.available(), reason="argosy_kernels.cpu_ops did not build here")
def test_int8_bfloat16_headless_model_runs_the_fused_cpu_decode_layers(headless_dir: Path) -> None:
    """bfloat16 on the CPU: packed linears, fused ops, and a short prompt (decode rows) through
    the C++ decode layers; the hidden states stay close to float32's."""
    ckpt = load_checkpoint(headless_dir)
    if ckpt.spec.attention_bias:
        pytest.skip("int8 linears with a bias (qwen2's q/k/v) have no C++ decode path")
    prompt = PROMPT[:6]  # up to CHUNK_AS_DECODE_ROWS tokens run as decode rows
    want = _hidden_states(build_model(ckpt, torch.float32, CPU, MAX_POSITIONS), prompt)
    model = build_model(ckpt, torch.bfloat16, CPU, MAX_POSITIONS, QuantizationConfig("int8"))
    assert model.cpu_decode is not None and model.lm_head is None
    model.cpu_decode = _CountingDecodeLayers(model.cpu_decode)
    got = _hidden_states(model, prompt)
    assert model.cpu_decode.calls == 1
    _assert_close_embeddings(got, want)


def test_prefixed_headless_names_load_the_same(headless_dir: Path, tmp_path: Path) -> None:
    """A headless config whose file keeps the `model.` prefix (saved from a causal LM's
    decoder) loads the same tensors."""
    folder = tmp_path / "prefixed"
    shutil.copytree(headless_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    save_file({f"model.{name}": t for name, t in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    plain = dict(load_checkpoint(headless_dir).iter_weights())
    prefixed = dict(load_checkpoint(folder).iter_weights())
    assert plain.keys() == prefixed.keys()
    assert all(torch.equal(plain[name], prefixed[name]) for name in plain)


def test_headless_errors_name_the_tensor(headless_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(headless_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    up = state.pop("layers.1.mlp.up_proj.weight")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights.*model\.layers\.1\.mlp\.up_proj"):
        list(load_checkpoint(folder).iter_weights())
    state["layers.1.mlp.up_proj.weight"] = up
    state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor 'lm_head.weight' for a headless"):
        list(load_checkpoint(folder).iter_weights())


def test_a_spec_cannot_tie_a_head_it_does_not_have() -> None:
    fields = dict(
        architecture="mistral", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        attention_bias=False, bos_token_id=None, eos_token_ids=(2,), checkpoint_dtype="float32",
    )
    assert ModelSpec(**fields, tie_word_embeddings=False, has_lm_head=False).has_lm_head is False
    with pytest.raises(ValueError, match="tie_word_embeddings needs an lm_head"):
        ModelSpec(**fields, tie_word_embeddings=True, has_lm_head=False)


@pytest.mark.parametrize("fixture", ["random_llama_dir", "random_qwen2_dir"])
def test_causal_lm_checkpoints_keep_their_head(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    ckpt = load_checkpoint(folder)
    assert ckpt.spec.has_lm_head is True
    model = build_model(ckpt, torch.float32, CPU, MAX_POSITIONS)
    assert isinstance(model.lm_head, nn.Linear)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == ckpt.spec.tie_word_embeddings
    with torch.inference_mode():
        logits = model.compute_logits(_hidden_states(model, PROMPT))
    assert logits.shape == (len(PROMPT), ckpt.spec.vocab_size)
