"""Sliding-window checkpoints (Mistral-7B v0.1, Qwen2 with use_sliding_window): Argosy attends
to the whole context, which equals windowed attention only while a sequence fits in the
window, so the engine serves such a model up to its window and refuses a longer
--max-model-len instead of silently answering with different attention."""

from __future__ import annotations

import json
import random

import pytest
import torch
from argosy_runtime import LLM, SamplingParams
from model_factory import make_random_model_dir

WINDOW = 48


def windowed_mistral(tmp_path, window: int | None):  # noqa: ANN001, ANN201
    folder = make_random_model_dir(tmp_path, "mistral", name=f"mistral-window-{window}",
                                   max_position_embeddings=256)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["sliding_window"] = window
    config_path.write_text(json.dumps(config))
    return folder


def hf_model(folder):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_serves_up_to_the_window_and_equals_transformers(tmp_path) -> None:  # noqa: ANN001
    folder = windowed_mistral(tmp_path, WINDOW)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.spec.sliding_window == WINDOW
    assert llm.engine.max_model_len == WINDOW  # not the 256 of max_position_embeddings
    reference = hf_model(folder)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(length)] for length in (1, 20, 30, 47)]
    params = [SamplingParams(max_tokens=WINDOW - len(p), temperature=0.0, ignore_eos=True)
              for p in prompts]  # each sequence ends exactly at the window
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, WINDOW - len(prompt))
    with pytest.raises(ValueError, match=rf"exceeds max_model_len \({WINDOW}\)"):
        llm.generate([[5] * WINDOW], SamplingParams(max_tokens=1))


def test_the_window_changes_attention_beyond_it(tmp_path) -> None:  # noqa: ANN001
    """Why the cap exists: past the window, transformers' windowed model and full attention
    disagree, so serving the whole context would answer differently from the checkpoint."""
    windowed, full = hf_model(windowed_mistral(tmp_path, WINDOW)), hf_model(windowed_mistral(tmp_path, None))
    ids = torch.tensor([[random.Random(4).randrange(3, 49152) for _ in range(2 * WINDOW)]])
    with torch.no_grad():
        a, b = windowed(ids).logits[0], full(ids).logits[0]
    # Same computation up to the window (bit-equal); every position past it sees less.
    assert torch.equal(a[:WINDOW], b[:WINDOW])
    assert bool(((a[WINDOW:] - b[WINDOW:]).abs().amax(dim=1) > 0).all())


def test_max_model_len_beyond_the_window_is_refused(tmp_path) -> None:  # noqa: ANN001
    folder = windowed_mistral(tmp_path, WINDOW)
    with pytest.raises(ValueError, match=rf"sliding attention window \({WINDOW}\).*--max-model-len {WINDOW}"):
        LLM(model=str(folder), dtype="float32", max_model_len=WINDOW + 1)
    assert LLM(model=str(folder), dtype="float32", max_model_len=32).engine.max_model_len == 32


def test_no_window_keeps_the_trained_context(tmp_path) -> None:  # noqa: ANN001
    llm = LLM(model=str(windowed_mistral(tmp_path, None)), dtype="float32")
    assert llm.engine.spec.sliding_window is None and llm.engine.max_model_len == 256
