"""GGUF files converted from random HF folders the way llama.cpp converts them: loading them
must give back exactly the original HF weights (q/k permutation undone for Llama, Qwen2 biases
and tied embeddings kept), and the original config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from model_factory import write_gguf_from_hf_dir
from safetensors.torch import load_file


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        state.update(load_file(str(file)))
    return state


@pytest.fixture(scope="module")
def llama_gguf(random_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_from_hf_dir(random_llama_dir, tmp_path_factory.mktemp("gguf") / "llama.gguf")


@pytest.fixture(scope="module")
def qwen2_gguf(random_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (tied, q/k/v bias) with F16 matrices and Qwen2's pre-tokenizer name."""
    out = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    return write_gguf_from_hf_dir(random_qwen2_dir, out, float16=True, pre="qwen2")


@pytest.mark.parametrize(
    ("hf_fixture", "gguf_fixture", "float16"),
    [("random_llama_dir", "llama_gguf", False), ("random_qwen2_dir", "qwen2_gguf", True)],
)
def test_gguf_round_trip_gives_original_weights(
    hf_fixture: str, gguf_fixture: str, float16: bool, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(hf_fixture)
    gguf_file: Path = request.getfixturevalue(gguf_fixture)
    from_gguf = load_checkpoint(str(gguf_file))
    from_hf = load_checkpoint(str(folder))
    assert from_gguf.format == "gguf"

    # GGUF stores rms_norm_eps as float32 (1e-5 -> 9.99999974e-06, as transformers reads it too).
    assert from_gguf.spec.rms_norm_eps == pytest.approx(from_hf.spec.rms_norm_eps, rel=1e-7)
    expected_spec = from_hf.spec.__dict__ | {
        "checkpoint_dtype": "float32",
        "rms_norm_eps": from_gguf.spec.rms_norm_eps,
    }
    # max_position_embeddings, rope, heads, bias, tying: all from metadata and tensor list.
    assert from_gguf.spec.__dict__ == expected_spec

    original = _hf_state(folder)
    weights = dict(from_gguf.iter_weights())
    assert set(weights) == {n for n, _ in from_hf.iter_weights()}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        expected = original[name].float()
        if float16 and expected.ndim == 2:
            expected = expected.half().float()
        assert torch.equal(tensor, expected), name


def test_qwen2_pre_tokenizer_matches_transformers(qwen2_gguf: Path) -> None:
    """tokenizer.ggml.pre = "qwen2" selects Qwen2's split regex, as in transformers."""
    from transformers import AutoTokenizer

    ours = load_checkpoint(str(qwen2_gguf)).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(qwen2_gguf.parent), gguf_file=qwen2_gguf.name)
    for text in ["Numbers 12345 and  100%", "it's   spaced\n\n\nlines", "日本語 text 🎉", "x=1;y=22"]:
        assert ours.encode(text) == theirs.encode(text), text
    # Qwen2's regex splits digits one by one; GPT-2's default keeps "12345" together.
    assert ours.convert_ids_to_tokens(ours.encode("12345")) == ["1", "2", "3", "4", "5"]


_LLAMACPP_LAYOUTS = {  # name -> (arch, make_random_model_dir kwargs, write as F16)
    # Mixtral is a "llama" file with expert_count; q/k rows permuted as for Llama.
    "mixtral": ("mixtral", dict(intermediate_size=32, extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2)), False),
    # ... and, in files from before llama.cpp merged experts, one tensor per expert.
    "mixtral-per-expert": ("mixtral", dict(intermediate_size=32, extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2)), False),
    # a dense layer (mlp_only_layers) beside a sparse one; F16 3-D expert tensors
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, extra_config=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])), True),
    "qwen2_moe": ("qwen2_moe", dict(extra_config=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)), False),
    "phi3-longrope": ("phi3", dict(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, rope_scaling={
            "rope_type": "longrope", "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(24)],
            "long_factor": [1.5 + 0.5 * i for i in range(24)]},
        extra_config={"original_max_position_embeddings": 64, "sliding_window": 32}), False),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, head_dim=32, tie_word_embeddings=True,
                              extra_config=dict(
        sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
               False),
}


@pytest.mark.parametrize("name", list(_LLAMACPP_LAYOUTS))
def test_llamacpp_layouts_give_original_weights(name: str, tmp_path: Path) -> None:
    """MoE experts merged per layer, Phi-3's fused qkv / gate-up and longrope tensors, Gemma 3's
    norms stored plus 1: read back as the folder's spec (up to float32 metadata) and weights."""
    from model_factory import make_random_model_dir

    arch, kwargs, float16 = _LLAMACPP_LAYOUTS[name]
    kwargs = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, **kwargs}
    folder = make_random_model_dir(tmp_path, arch, name=name, **kwargs)
    gguf_file = write_gguf_from_hf_dir(folder, tmp_path / f"{name}.gguf", float16=float16,
                                       merge_experts=name != "mixtral-per-expert")
    if arch == "mixtral":
        from argosy_runtime.model_loader.gguf_metadata import open_gguf

        stored = {t.name for t in open_gguf(gguf_file).tensors}
        merged = name == "mixtral"
        assert ("blk.0.ffn_gate_exps.weight" in stored) == merged
        assert ("blk.0.ffn_gate.3.weight" in stored) != merged
    from_gguf, from_hf = load_checkpoint(str(gguf_file)), load_checkpoint(str(folder))
    ours, theirs = from_gguf.spec.__dict__, from_hf.spec.__dict__
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-7)
    scaling = {k: ours["rope_scaling"][k] for k in (ours["rope_scaling"] or {})}
    for key in ("short_factor", "long_factor", "attention_factor"):  # float32 in the file
        if key in scaling:
            assert scaling[key] == pytest.approx(theirs["rope_scaling"][key], rel=1e-7)
            scaling[key] = theirs["rope_scaling"][key]
    assert ours | {"checkpoint_dtype": theirs["checkpoint_dtype"], "rms_norm_eps":
                   theirs["rms_norm_eps"], "rope_scaling": scaling or None} == theirs

    weights = dict(from_gguf.iter_weights())
    original = dict(from_hf.iter_weights())
    assert set(weights) == set(original)
    routers = (".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    for key, tensor in weights.items():
        expected = original[key].float()
        if float16 and expected.ndim == 2 and not key.endswith(routers):
            expected = expected.half().float()
        # Gemma 3's norms went through + 1 and - 1 in float32.
        atol = 2e-7 if arch == "gemma3" and key.endswith("norm.weight") else 0.0
        assert torch.allclose(tensor, expected, rtol=0, atol=atol), key
    # Raw tensors (the quantized-load path): the split / shifted ones come as float32 tensors.
    raw = dict(from_gguf.iter_raw_gguf_tensors())
    assert set(raw) == set(original)


# transformers 5's own GGUF reader (qwen3moe, qwen2moe, phi3, gemma3; it reads a Mixtral
# "llama" file as a dense Llama, so Mixtral cannot be checked this way) as an independent check
# of write_gguf_from_hf_dir. It does not read everything llama.cpp writes (expert sizes, longrope
# factors, the Gemma 3 window's details, query_pre_attn_scalar): those are at its defaults here.
_TRANSFORMERS_READABLE = {
    "qwen3_moe": dict(head_dim=32, extra_config=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)),
    "qwen2_moe": dict(init_std=0.05, extra_config=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632)),
    "phi3": dict(max_position_embeddings=256,
                 extra_config={"original_max_position_embeddings": 256}),
    "gemma3": dict(num_hidden_layers=6, head_dim=256, tie_word_embeddings=True, extra_config=dict(
        sliding_window=8, query_pre_attn_scalar=256,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


@pytest.mark.parametrize("arch", list(_TRANSFORMERS_READABLE))
def test_transformers_reads_written_gguf_as_the_folder(arch: str, tmp_path: Path) -> None:
    from model_factory import make_random_model_dir
    from transformers import AutoModelForCausalLM

    kwargs = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, **_TRANSFORMERS_READABLE[arch]}
    folder = make_random_model_dir(tmp_path, arch, **kwargs)
    gguf_file = write_gguf_from_hf_dir(folder, folder / f"{arch}.gguf")
    ids = torch.tensor([[5, 900, 33, 1200, 7, 8, 4000, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file.name,
                                                   dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
