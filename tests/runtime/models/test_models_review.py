"""Config knobs transformers honours, swept over tiny random models (2 layers, hidden 64):
each either gives transformers' greedy tokens in float32 (a short prompt and one longer than
any sliding window set) or is refused at load with a ValueError naming it. Silently wrong
output is the failure this file looks for.

Also the two bugs this review found: a config that ties the lm_head to the embeddings over a
checkpoint that stores its own, different lm_head (transformers serves the stored head), and
a BERT / XLM-R config with `is_decoder: true` (transformers attends causally).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: the factories

from argosy_runtime import LLM, SamplingParams  # noqa: E402
from argosy_runtime.model_loader import load_checkpoint  # noqa: E402
from encoder_factory import make_encoder_dir  # noqa: E402
from model_factory import edit_config, make_random_model_dir  # noqa: E402

NUM_TOKENS = 6
# Gemma's norms scale by 1 + w: a smaller init keeps its logits away from near-ties.
GEMMA = dict(head_dim=32, init_std=0.15)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TWO_TYPES = ["sliding_attention", "full_attention"]


def _prompts() -> list[list[int]]:
    """A short prompt and one of 40 tokens: past every window of 8 set below."""
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40)]


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own forward and KV cache, greedy."""
    ids = []
    out = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(n):
        ids.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return ids


def _assert_greedy_equals_transformers(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt in _prompts():
        [out] = llm.generate([prompt], params)
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, NUM_TOKENS), len(prompt)



# (id, arch, make_random_model_dir keywords): each a knob at a non-default value.
SERVED_KNOBS = [
    ("llama-tied", "llama", dict(tie_word_embeddings=True)),
    ("llama-head_dim", "llama", dict(head_dim=32)),
    ("llama-theta-eps", "llama", dict(rope_theta=500.0, rms_norm_eps=1e-2)),
    ("llama-linear", "llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    ("llama-llama3", "llama", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    ("qwen3-yarn", "qwen3", dict(head_dim=32, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, truncate=False))),
    ("mistral-window", "mistral", dict(head_dim=32, extra_config=dict(sliding_window=8))),
    ("qwen2-max_window_layers", "qwen2", dict(extra_config=dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=1))),
    ("qwen3-window", "qwen3", dict(head_dim=32, extra_config=dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=1))),
    ("phi3-partial-rotary-tied", "phi3", dict(tie_word_embeddings=True, extra_config=dict(
        partial_rotary_factor=0.75, sliding_window=8))),
    ("gemma3-scalar-softcap", "gemma3", dict(**GEMMA, extra_config=dict(
        sliding_window=8, query_pre_attn_scalar=20, final_logit_softcapping=3.0,
        layer_types=TWO_TYPES))),
    ("gemma3-pattern-untied", "gemma3", dict(**GEMMA, num_hidden_layers=3,
                                             tie_word_embeddings=False, extra_config=dict(
        sliding_window=8, sliding_window_pattern=2))),
    ("gemma2-softcaps", "gemma2", dict(**GEMMA, extra_config=dict(
        sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=20))),
    ("granite-multipliers", "granite", dict(head_dim=32, extra_config=dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
        logits_scaling=2.0))),
    ("smollm3-nope-window", "smollm3", dict(extra_config=dict(
        no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8, pad_token_id=0))),
    ("mixtral-window", "mixtral", dict(extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8))),
    ("qwen2_moe-shared-norm_topk", "qwen2_moe", dict(extra_config=dict(
        **MOE, shared_expert_intermediate_size=48, norm_topk_prob=True, qkv_bias=False))),
    ("qwen3_moe-mlp_only-unnormed", "qwen3_moe", dict(head_dim=32, extra_config=dict(
        **MOE, norm_topk_prob=False, mlp_only_layers=[0]))),
]


@pytest.mark.parametrize("arch,kwargs", [pytest.param(a, k, id=i) for i, a, k in SERVED_KNOBS])
def test_knob_gives_transformers_greedy_tokens(arch: str, kwargs: dict, tmp_path: Path) -> None:
    _assert_greedy_equals_transformers(make_random_model_dir(tmp_path, arch, **kwargs))


@pytest.mark.parametrize("arch,fields,message", [
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    ("qwen2", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     "dynamic"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
])
def test_unserved_knob_is_refused_naming_it(arch: str, fields: dict, message: str,
                                            tmp_path: Path) -> None:
    folder = make_random_model_dir(tmp_path, arch, num_hidden_layers=1)
    edit_config(folder, lambda config: config.update(fields))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), dtype="float32", block_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_config_over_a_distinct_stored_lm_head_serves_the_stored_head(
        arch: str, tmp_path: Path) -> None:
    # An untied checkpoint whose config says tie_word_embeddings: transformers keeps the
    # stored lm_head (it differs from the embeddings); tying it served another model.
    folder = make_random_model_dir(tmp_path, arch, tie_word_embeddings=False)
    edit_config(folder, lambda config: config.update(tie_word_embeddings=True))
    assert not load_checkpoint(folder).spec.tie_word_embeddings
    _assert_greedy_equals_transformers(folder)


def test_stored_lm_head_equal_to_the_embeddings_stays_tied(tmp_path: Path) -> None:
    # Both stored, the same values (what a .bin conversion writes): one matrix, as before.
    from safetensors.torch import load_file, save_file

    folder = make_random_model_dir(tmp_path, "llama", tie_word_embeddings=True)
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert load_checkpoint(folder).spec.tie_word_embeddings
    _assert_greedy_equals_transformers(folder)


@pytest.mark.parametrize("arch", ["bert", "xlm_roberta"])
def test_encoder_with_is_decoder_is_refused(arch: str, tmp_path: Path) -> None:
    # transformers' BERT / XLM-R layers attend causally then; ours attend both ways.
    folder = make_encoder_dir(tmp_path, arch)
    edit_config(folder, lambda config: config.update(is_decoder=True))
    with pytest.raises(ValueError, match="is_decoder"):
        load_checkpoint(folder)
