"""LoRA adapters in the batch-invariant mode: a request on an adapter gets the same tokens and
logprobs alone and beside base-model and other-adapter requests, its prompt chunked into
other sizes (a random-weight Llama with head_dim 64 and two random PEFT adapters, bf16)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from argosy_kernels import cpu_ops
from argosy_runtime import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import tokens_and_logprobs  # noqa: E402
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402
from test_lora_engine import ALL  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_ops.has_avx512_bf16(),
                                reason="the batch-invariant mode needs AVX512-BF16")

TARGET = [5, 100, 2000, 300, 45, 999, 17, 4242, 8, 31000, 77, 12] * 4  # 48 tokens
OTHERS = [[9, 8, 7, 6, 5] * 6, [40000, 123, 456, 789] * 9, [11, 22, 33] * 7, [7] * 20]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("lora-invariant")
    model = make_random_model_dir(tmp / "model", hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    adapters = {"a": str(make_peft_adapter(model, tmp / "a", 1, r=8, lora_alpha=16, target_modules=ALL)),
                "b": str(make_peft_adapter(model, tmp / "b", 2, r=4, lora_alpha=8,
                                      target_modules=["q_proj", "v_proj", "down_proj"]))}
    return model, adapters


def test_adapter_request_same_bits_alone_and_in_a_mixed_batch(setup) -> None:
    model, adapters = setup
    common = dict(model=str(model), dtype="bfloat16", batch_invariant=True, lora_modules=adapters)
    alone = tokens_and_logprobs(LLM(**common).generate([TARGET], PARAMS, lora_name="a")[0])
    # 16 tokens a step: the 48-token prompt in chunks beside others' chunks and decodes; the
    # default mode would switch the adapter's delta from the fused pass to GEMMs past 16 rows.
    busy = LLM(**common, max_num_batched_tokens=16).engine
    for i, prompt in enumerate(OTHERS):
        busy.add_request(f"o{i}", prompt, PARAMS, lora_name=[None, "b", "a", None][i])
    busy.add_request("target", TARGET, PARAMS, lora_name="a")
    done = {}
    while busy.has_unfinished_requests():
        for out in busy.step():
            if out.finished:
                done[out.request_id] = out
    assert tokens_and_logprobs(done["target"]) == alone
    assert tokens_and_logprobs(done["o2"]) != alone  # another prompt on the same adapter: not trivially equal
