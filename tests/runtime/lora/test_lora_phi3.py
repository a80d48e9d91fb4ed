"""LoRA adapters on Phi-3, whose checkpoints store q/k/v and gate/up fused: PEFT adapters for it
target `qkv_proj` and `gate_up_proj` whole (one A, one B over the fused output) beside o_proj
and down_proj. Through the engine they equal transformers + PEFT in float32 (tokens, and
logprobs within 1e-4), batched with base-model requests; bfloat16 (C++ decode layers) runs;
a fused B of the wrong size, or a fused name on a model that names q/k/v apart, is a clear
ValueError."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLMEngine
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks, greedy, run_requests  # noqa: E402
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402

FUSED = ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("phi3-lora")
    model_dir = make_random_model_dir(tmp, "phi3", name="phi3", init_std=0.2,
                                      max_position_embeddings=256,
                                      extra_config={"original_max_position_embeddings": 256})
    adapters = {
        "fused": make_peft_adapter(model_dir, tmp / "fused", 1, r=8, lora_alpha=16,
                              target_modules=FUSED),
        "qkv-rs": make_peft_adapter(model_dir, tmp / "qkv", 2, r=4, lora_alpha=8, use_rslora=True,
                               target_modules=["qkv_proj"]),
    }
    return model_dir, adapters


@torch.no_grad()
def peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]
                ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens and each step's log-softmax, one full forward per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    for prompt in prompts:
        ids, logprobs = list(prompt), []
        for _ in range(MAX_TOKENS):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            logprobs.append(lp)
            ids.append(int(lp.argmax()))
        outs.append((ids[len(prompt):], logprobs))
    return outs


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(n)] for n in lengths]


def run(engine: LLMEngine, jobs: list[tuple[str | None, list[int]]]) -> list:
    """jobs: (adapter name or None, prompt); all added at once. Their final RequestOutputs."""
    return run_requests(engine, [(prompt, greedy(MAX_TOKENS)) for _, prompt in jobs],
                        [lora for lora, _ in jobs])


def test_fused_adapters_and_base_in_one_batch_equal_peft(phi3) -> None:  # noqa: ANN001
    model_dir, adapters = phi3
    spec = load_checkpoint(str(model_dir)).spec
    loaded = LoRAAdapter.load("fused", adapters["fused"], spec, torch.float32)
    q_kv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    assert loaded.layers[0]["qkv_proj"].b.shape == (q_kv, 8)  # one pair over the fused output
    assert loaded.layers[0]["gate_up_proj"].b.shape == (2 * spec.intermediate_size, 8)

    ps = prompts(1, (13, 5))
    refs = {name: peft_greedy(model_dir, path, ps) for name, path in adapters.items()}
    refs[None] = peft_greedy(model_dir, None, ps)
    for name in adapters:
        assert [t for t, _ in refs[name]] != [t for t, _ in refs[None]]  # the adapter matters
    # Prefill chunks of 8 tokens: adapter rows follow their requests through chunking.
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       max_num_batched_tokens=8,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    jobs = [(lora, p) for p in range(len(ps)) for lora in ("fused", None, "qkv-rs")]
    outputs = run(engine, [(lora, ps[p]) for lora, p in jobs])
    for (lora, p), out in zip(jobs, outputs, strict=True):
        tokens, logprobs = refs[lora][p]
        seq = out.outputs[0]
        assert seq.token_ids == tokens, (lora, p)
        for pos, token in enumerate(tokens):
            got = seq.logprobs[pos][token].logprob
            assert abs(got - logprobs[pos][token].item()) < 1e-4, (lora, p, pos)
    assert_no_leaks(engine)


def test_fused_adapter_on_bfloat16(phi3, monkeypatch) -> None:  # noqa: ANN001
    """bf16 on the CPU: decode steps go through the C++ decode layers where they built, which
    take the adapter's fused (A, B) pairs as they are. A request's output does not depend on
    the base rows batched with it, and the adapter changes it."""
    from argosy_runtime.lora import LoRABatch

    model_dir, adapters = phi3
    engine = LLMEngine(model=str(model_dir), dtype="bfloat16", block_size=4,
                       lora_modules={"fused": str(adapters["fused"])})
    layer_args = []
    original = LoRABatch.decode_layer_args

    def spy(self, layer):  # noqa: ANN001, ANN202
        layer_args.append(original(self, layer))
        return layer_args[-1]

    monkeypatch.setattr(LoRABatch, "decode_layer_args", spy)
    prompt = prompts(2, (9,))[0]
    base, with_lora = (out.outputs[0].token_ids for out in
                       run(engine, [(None, prompt), ("fused", prompt)]))
    alone = run(engine, [("fused", prompt)])[0].outputs[0].token_ids
    assert with_lora != base and with_lora == alone
    if engine.model.ops == "cpu_ops" and engine.model.cpu_decode is not None:
        # rows, then (A, B) of qkv, o, gate_up, down: the fused ones whole
        spec = engine.spec
        q_kv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
        tensors, scales = layer_args[0]
        assert scales == [2.0] and tensors[2].shape == (q_kv, 8)
        assert tensors[6].shape == (2 * spec.intermediate_size, 8)
    assert_no_leaks(engine)


def test_fused_b_of_the_wrong_size_is_a_value_error(phi3, tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    model_dir, adapters = phi3
    folder = tmp_path / "adapter"
    shutil.copytree(adapters["fused"], folder)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if "qkv_proj.lora_B" in k)
    tensors[key] = tensors[key][:-8].contiguous()  # q and k only, say: v's rows missing
    save_file(tensors, str(path))
    spec = load_checkpoint(str(model_dir)).spec
    with pytest.raises(ValueError, match=r"qkv_proj has shapes .*\(B spans the whole fused "
                                         r"qkv_proj: the rows of q_proj, k_proj, v_proj"):
        LoRAAdapter.load("bad", folder, spec, torch.float32)


def test_fused_names_on_a_llama_checkpoint_are_a_value_error(tmp_path) -> None:  # noqa: ANN001
    """Llama names q/k/v and gate/up apart, so its adapters do too: one naming qkv_proj was
    made for another model."""
    from safetensors.torch import load_file, save_file

    model_dir = make_random_model_dir(tmp_path, "llama", num_hidden_layers=1)
    folder = make_peft_adapter(model_dir, tmp_path / "adapter", 3, r=4,
                          target_modules=["gate_proj", "o_proj"])
    path = folder / "adapter_model.safetensors"
    save_file({k.replace("gate_proj", "gate_up_proj"): v for k, v in load_file(str(path)).items()},
              str(path))
    spec = load_checkpoint(str(model_dir)).spec
    with pytest.raises(ValueError, match=r"gate_up_proj: a llama checkpoint names this "
                                         r"projection's parts separately \(gate_proj, up_proj\)"):
        LoRAAdapter.load("bad", folder, spec, torch.float32)
