"""A self-draft runs the target's own first layers on the target's own cache, so a request's
LoRA adapter must apply in them as it does in the target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from engine_helpers import assert_no_leaks, run_requests  # noqa: E402
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_full_depth_self_draft_applies_the_requests_adapter(tmp_path: Path) -> None:
    # Every layer as the draft: with the adapter applied as in the target, every draft is
    # the target's own argmax. Without it, the draft's queries (base weights) met the
    # adapter's K/V in the shared cache and nearly no draft of an adapter request passed.
    model = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)
    # An adapter strong enough to change the greedy output (checked below).
    lora = make_peft_adapter(model, tmp_path / "a", 1, r=4, lora_alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    requests = [(p, params) for p in prompts] * 2
    adapters = ["a"] * 3 + [None] * 3  # the same prompts on the adapter and on the base model

    def outputs(engine: LLMEngine) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in run_requests(engine, requests, adapters)]

    options = dict(dtype="float32", block_size=4, lora_modules={"a": str(lora)})
    expected = outputs(LLMEngine(model=str(model), **options))
    assert expected[:3] != expected[3:], "the adapter changes the output"
    engine = LLMEngine(model=str(model), **options, speculative={
        "method": "draft", "draft_layers": 2, "num_speculative_tokens": 4, "adaptive": False})
    assert outputs(engine) == expected
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)
