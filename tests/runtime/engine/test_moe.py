"""Mixture-of-Experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated shared expert)
equal transformers 5: greedy tokens and logprobs in float32 through chunked prefill, prefix-cache
hits, preemption and concurrent sequences; bfloat16 close; int8-quantized experts close; the
per-expert Hub layout and transformers' fused 3-D layout load the same; llama.cpp GGUF files
(qwen3moe, qwen2moe, Mixtral as "llama" with experts; experts merged per layer) equal the
folder. And clear errors where MoE is not supported: LoRA on expert MLPs, GPTQ calibration, a
GGUF MoE file without experts; CUDA graphs off."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLM, LLMEngine, SamplingParams
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.model_loader.gguf_metadata import open_gguf
from argosy_runtime.model_runner import use_cuda_graphs
from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from argosy_runtime.models.llama import LlamaForCausalLM
from argosy_runtime.models.moe import SparseMoeBlock
from engine_helpers import assert_no_leaks, run_requests
from model_factory import (
    EMBEDDED_VOCAB_SIZE,
    embedded_tokenizer_files,
    make_random_model_dir,
    write_gguf_from_hf_dir,
    write_tiny_gguf,
)
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
# arch -> (make_random_model_dir kwargs, the layers that are sparse)
MODELS = {
    # every layer sparse; experts of intermediate_size; top-2 renormalized
    "mixtral": (dict(intermediate_size=32, extra_config=dict(
        num_local_experts=4, num_experts_per_tok=2)), (0, 1)),
    # head_dim apart from hidden / heads (q/k norms); layer 1 dense through mlp_only_layers
    "qwen3_moe": (dict(head_dim=32, extra_config=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])), (0,)),
    # q/k/v bias, a sigmoid-gated shared expert, top-k not renormalized; layer 0 dense
    # through decoder_sparse_step 2
    "qwen2_moe": (dict(extra_config=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2)), (1,)),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("moe")
    return {arch: make_random_model_dir(tmp, arch, **SHAPE, **kwargs)
            for arch, (kwargs, _) in MODELS.items()}


@pytest.fixture(scope="module")
def moe_refs(moe_dirs: dict[str, Path], hf_reference) -> dict:  # noqa: ANN001
    return {arch: hf_reference(path) for arch, path in moe_dirs.items()}


def prompts(seed: int, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, EMBEDDED_VOCAB_SIZE) for _ in range(rng.randint(1, 40))]
            for _ in range(count)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def stored_names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def assert_equal_to_transformers(outputs: list, ref, n: int) -> None:  # noqa: ANN001
    for o in outputs:
        seq = o.outputs[0]
        assert seq.token_ids == ref.greedy(o.prompt_token_ids, n)
        expected = ref.greedy_logprobs(o.prompt_token_ids, n)
        for pos, token in enumerate(seq.token_ids):
            assert abs(seq.logprobs[pos][token].logprob - expected[pos][token].item()) < 1e-4


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_tokens_and_logprobs_equal_transformers(arch: str, moe_dirs, moe_refs) -> None:  # noqa: ANN001
    # The folder holds the per-expert Hub layout (what save_pretrained writes by default).
    names = stored_names(moe_dirs[arch])
    expert = ("block_sparse_moe.experts.0.w1.weight" if arch == "mixtral"
              else "mlp.experts.0.gate_proj.weight")
    assert any(n.endswith(expert) for n in names)
    # 16-token budget: the longer prompts prefill in chunks beside the others' decodes.
    llm = LLM(model=str(moe_dirs[arch]), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == arch and spec.sparse_layers == MODELS[arch][1]
    layers = llm.engine.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [
        i in MODELS[arch][1] for i in range(len(layers))]
    assert_equal_to_transformers(llm.generate(prompts(1), greedy(12)), moe_refs[arch], 12)
    assert_no_leaks(llm.engine)


def test_prefix_hits_and_preemption_equal_transformers(moe_dirs, moe_refs) -> None:  # noqa: ANN001
    # Per token: 2 layers x (K, V) x 2 kv heads x 32 dims x 4 bytes = 1 KiB; 24 blocks of 4
    # tokens cannot hold 6 sequences of ~30 tokens: the newest are preempted and recomputed.
    engine = LLMEngine(model=str(moe_dirs["qwen3_moe"]), dtype="float32", block_size=4,
                       max_num_batched_tokens=8, kv_cache_memory=24 * 4 * 1024)
    rng = random.Random(3)
    prefix = [rng.randrange(3, EMBEDDED_VOCAB_SIZE) for _ in range(12)]
    requests = [(prefix + [rng.randrange(3, EMBEDDED_VOCAB_SIZE) for _ in range(rng.randint(1, 8))],
                 greedy(12)) for _ in range(6)]
    outputs = run_requests(engine, requests)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_equal_to_transformers(outputs, moe_refs["qwen3_moe"], 12)
    assert_no_leaks(engine)


def test_speculative_decoding_keeps_the_moe_targets_output(moe_dirs, moe_refs) -> None:  # noqa: ANN001
    # An int8 copy of the MoE model drafts, the float32 MoE target verifies: each step routes
    # a chunk of 1 + k tokens, and the output is still the target's own greedy output.
    llm = LLM(model=str(moe_dirs["mixtral"]), dtype="float32", block_size=4,
              speculative={"method": "draft", "quantization": "int8", "num_speculative_tokens": 3})
    assert_equal_to_transformers(llm.generate(prompts(5, 3), greedy(12)), moe_refs["mixtral"], 12)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_bfloat16_packed_experts_stay_close(arch: str, moe_dirs) -> None:  # noqa: ANN001
    """Against transformers in bfloat16: a random router's near-ties flip experts between
    bf16 and float32 (logprobs up to ~0.7 apart here), not between two bf16 forwards that
    round the routing the same way (Mixtral's float32 weights, Qwen's cast ones)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(moe_dirs[arch]), dtype=torch.bfloat16).eval()
    llm = LLM(model=str(moe_dirs[arch]), dtype="bfloat16", block_size=4)
    model = llm.engine.model
    # MoE layers keep the module path: no C++ decode layers (build declines, not crashes)
    assert model.cpu_decode is None and CpuDecodeLayers.build(model.model) is None
    moe = model.model.layers[MODELS[arch][1][0]].mlp
    if torch.backends.mkldnn.is_available():
        assert type(moe.experts[0].gate_up_proj).__name__ == "PackedLinear"
    assert moe.experts[0].ops == model.ops  # the fused SiLU x up, as in the dense MLP
    agree = total = 0
    for p, o in zip(prompts(3), llm.generate(prompts(3), greedy(1))):
        with torch.no_grad():
            expected = torch.log_softmax(ref(torch.tensor([p])).logits[0, -1].float(), dim=-1)
        got = o.outputs[0]
        total += 1
        agree += got.token_ids[0] == int(expected.argmax())
        assert abs(got.logprobs[0][got.token_ids[0]].logprob
                   - expected[got.token_ids[0]].item()) < 0.15
    assert agree >= total - 1  # a bf16 near-tie may flip one


def test_int8_quantizes_the_experts_and_stays_close(moe_dirs, moe_refs) -> None:  # noqa: ANN001
    from argosy_runtime.quantization import Int8Linear

    llm = LLM(model=str(moe_dirs["qwen2_moe"]), dtype="float32", quantization="int8", block_size=4)
    moe = llm.engine.model.model.layers[1].mlp
    assert all(isinstance(e.gate_up_proj, Int8Linear) and isinstance(e.down_proj, Int8Linear)
               for e in moe.experts)
    assert isinstance(moe.shared_expert.gate_up_proj, Int8Linear)
    assert type(moe.gate) is nn.Linear and type(moe.shared_expert_gate) is nn.Linear  # float
    assert not moe.use_fused_experts()  # the Triton path's grouped GEMMs: unquantized only
    agree = total = 0
    for p, o in zip(prompts(4), llm.generate(prompts(4), greedy(1))):
        expected = moe_refs["qwen2_moe"].greedy_logprobs(p, 1)[0]
        got = o.outputs[0]
        total += 1
        agree += got.token_ids[0] == int(expected.argmax())
        assert abs(got.logprobs[0][got.token_ids[0]].logprob
                   - expected[got.token_ids[0]].item()) < 0.3
    assert agree >= total - 1


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_loads_the_same(arch: str, moe_dirs, tmp_path) -> None:  # noqa: ANN001
    """transformers 5 keeps experts as 3-D tensors in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) and writes them so with save_original_format=False."""
    from transformers import AutoModelForCausalLM

    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(str(moe_dirs[arch]), dtype=torch.float32).save_pretrained(
        fused, save_original_format=False)
    for file_name, content in embedded_tokenizer_files().items():
        (fused / file_name).write_bytes(content)
    layer = MODELS[arch][1][0]
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in stored_names(fused)
    hub = LLM(model=str(moe_dirs[arch]), dtype="float32", block_size=4)
    got = LLM(model=str(fused), dtype="float32", block_size=4)
    for a, b in zip(hub.engine.model.state_dict().items(), got.engine.model.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    ps = prompts(5, count=2)
    assert ([o.outputs[0].token_ids for o in got.generate(ps, greedy(6))]
            == [o.outputs[0].token_ids for o in hub.generate(ps, greedy(6))])


def test_checkpoint_missing_an_expert_is_a_value_error(moe_dirs, tmp_path) -> None:  # noqa: ANN001
    folder = tmp_path / "missing"
    folder.mkdir()
    for f in moe_dirs["mixtral"].iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    with safe_open(str(moe_dirs["mixtral"] / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "experts.3.w2" not in k}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 2 weights"):
        LLM(model=str(folder), dtype="float32")


def _write_gguf(path: Path, arch: str, experts: int) -> Path:
    def moe(writer) -> None:  # noqa: ANN001
        writer.add_expert_count(experts)
        writer.add_expert_used_count(min(experts, 2))

    return write_tiny_gguf(path, arch, extra=moe)


@pytest.mark.parametrize("arch", list(MODELS))
def test_gguf_file_equals_transformers(arch: str, moe_dirs, moe_refs, tmp_path) -> None:  # noqa: ANN001
    # llama.cpp's layout: 3-D ffn_{gate,up,down}_exps per sparse layer, ffn_gate_inp routers,
    # Qwen2-MoE's *_shexp; Mixtral is "llama" with expert_count and permuted q/k rows.
    gguf = write_gguf_from_hf_dir(moe_dirs[arch], tmp_path / f"{arch}.gguf")
    names = [t.name for t in open_gguf(gguf).tensors]
    assert f"blk.{MODELS[arch][1][0]}.ffn_gate_exps.weight" in names
    llm = LLM(model=str(gguf), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec, folder_spec = llm.engine.spec, load_checkpoint(str(moe_dirs[arch])).spec
    assert spec.architecture == arch and spec.sparse_layers == MODELS[arch][1]
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "shared_expert_intermediate_size", "attention_bias"):
        assert getattr(spec, field) == getattr(folder_spec, field), field
    assert_equal_to_transformers(llm.generate(prompts(2), greedy(10)), moe_refs[arch], 10)
    assert_no_leaks(llm.engine)


def test_gguf_moe_file_without_experts_is_a_value_error(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="GGUF llama file has no experts.*expert_count 4"):
        load_checkpoint(str(_write_gguf(tmp_path / "moe.gguf", "llama", 4)))


def _write_adapter(folder: Path, spec, modules: list[str]) -> Path:  # noqa: ANN001
    """A PEFT-layout adapter (r 4) on `modules` ("layers.0.self_attn.q_proj", ...)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                            "lora_alpha": 8}))
    sizes = {"q_proj": (64, 128), "v_proj": (64, 64), "gate_proj": (64, 128),
             "experts.0.gate_proj": (64, 32), "shared_expert.gate_proj": (64, 48)}
    tensors = {}
    for module in modules:
        fan_in, fan_out = sizes[module.split(".", 3)[-1]]
        key = f"base_model.model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(4, fan_in)
        tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 4)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_lora_on_moe_mlps_is_a_value_error_attention_adapters_load(moe_dirs, tmp_path) -> None:  # noqa: ANN001
    spec = load_checkpoint(str(moe_dirs["qwen3_moe"])).spec  # layer 0 sparse, layer 1 dense
    bad = {"sparse-mlp": ["layers.0.mlp.gate_proj"], "expert": ["layers.0.mlp.experts.0.gate_proj"]}
    for name, modules in bad.items():
        with pytest.raises(ValueError, match="Mixture-of-Experts"):
            LoRAAdapter.load(name, _write_adapter(tmp_path / name, spec, modules), spec,
                             torch.float32)
    ok = LoRAAdapter.load("attn", _write_adapter(
        tmp_path / "attn", spec, ["layers.0.self_attn.q_proj", "layers.1.self_attn.v_proj",
                                  "layers.1.mlp.gate_proj"]), spec, torch.float32)
    assert set(ok.layers[0]) == {"qkv_proj"} and set(ok.layers[1]) == {"qkv_proj", "gate_up_proj"}
    # ... and runs on the MoE model (attention deltas; the dense layer's MLP delta)
    engine = LLMEngine(model=str(moe_dirs["qwen3_moe"]), dtype="float32", block_size=4,
                       lora_modules={"attn": str(tmp_path / "attn")})
    p = prompts(6, count=1)[0]
    engine.add_request("base", p, greedy(4))
    engine.add_request("lora", p, greedy(4), lora_name="attn")
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
    assert done["lora"] != done["base"]  # the adapter applies
    assert_no_leaks(engine)


def test_gptq_calibration_on_moe_is_a_value_error(moe_dirs) -> None:  # noqa: ANN001
    from argosy_runtime.quantization import QuantizationConfig, load_quantized_weights

    checkpoint = load_checkpoint(str(moe_dirs["mixtral"]))
    model = LlamaForCausalLM(checkpoint.spec)
    with pytest.raises(ValueError, match="GPTQ calibration does not support Mixture-of-Experts"):
        load_quantized_weights(model, checkpoint, QuantizationConfig("int4", algorithm="gptq"))


def test_cuda_graphs_are_off_for_moe_models(moe_dirs, caplog) -> None:  # noqa: ANN001
    moe = load_checkpoint(str(moe_dirs["mixtral"])).spec
    dense = load_checkpoint(str(moe_dirs["mixtral"]),
                            hf_overrides={"architectures": ["MistralForCausalLM"]}).spec
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="argosy.engine"):
        assert not use_cuda_graphs(cuda, True, moe)
    assert "CUDA graphs off: mixtral is a Mixture-of-Experts model" in caplog.text
    assert use_cuda_graphs(cuda, True, dense)
    assert not use_cuda_graphs(cuda, False, dense)  # enforce_eager
    assert not use_cuda_graphs(cpu, True, dense)
