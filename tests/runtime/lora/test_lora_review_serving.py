"""Adapter configs PEFT serves that the server must serve too (real adapters saved by PEFT,
compared with PEFT's own forward):

- `lora_alpha: 0` with an `alpha_pattern` (only the listed modules adapt): loading it divided
  by the adapter's scale, 0, a ZeroDivisionError (an HTTP 500, or a failed startup)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from argosy_runtime import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import (  # noqa: E402
    FullForwardReference,
    assert_equals_reference,
    greedy,
    random_prompts,
    run_requests,
)
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402


def test_lora_alpha_zero_with_an_alpha_pattern_equals_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llama_dir = make_random_model_dir(tmp_path / "m", "llama", num_hidden_layers=2)
    folder = make_peft_adapter(llama_dir, tmp_path / "a", 1, r=4, lora_alpha=0,
                               target_modules=["q_proj", "v_proj"],
                               alpha_pattern={"v_proj": 16})
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    ref = FullForwardReference(PeftModel.from_pretrained(base, str(folder)).eval())
    prompts = random_prompts(5, (7, 10))
    engine = LLMEngine(model=str(llama_dir), dtype="float32", block_size=4,
                       lora_modules={"a": str(folder)})
    outs = run_requests(engine, [(p, greedy(6)) for p in prompts], ["a", "a"])
    assert_equals_reference(outs, prompts, ref, 6)
    # v_proj's alpha matters: the base model answers otherwise.
    plain = FullForwardReference.from_folder(llama_dir)
    assert any((ref.greedy(p, 6)[1][i] - plain.greedy(p, 6)[1][i]).abs().max() > 1e-3
               for p in prompts for i in range(6))
