"""Matryoshka embeddings (`PoolingParams(dimensions=k)`, the `dimensions` of /v1/embeddings)
and `hf_overrides` (vLLM's --hf-overrides, how a user marks Qwen3-Embedding as Matryoshka).

A Matryoshka-trained model's embedding is cut to its first k values, then normalized: the
reference is transformers' last hidden state, cut and normalized the same way. A model whose
config says nothing is refused a shorter size (cutting it would silently give poor vectors).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from argosy_runtime import LLM, PoolingParams
from argosy_runtime.cli.main import build_parser
from argosy_runtime.model_loader import ModelSpec
from engine_helpers import assert_no_leaks

PROMPTS = [[1, 504, 3458, 314, 4649, 315, 260, 1789], [77], [9015, 2, 41, 88, 12000] * 5]


def cut(hf, prompt: list[int], dimensions: int) -> torch.Tensor:  # noqa: ANN001
    return F.normalize(hf.hidden_states(prompt)[-1][:dimensions], dim=0)


def test_any_size_with_is_matryoshka_equals_transformers_cut(random_llama_dir,  # noqa: ANN001
                                                             random_llama_hf) -> None:
    llm = LLM(model=str(random_llama_dir), dtype="float32", block_size=4,
              hf_overrides={"is_matryoshka": True})
    assert llm.engine.spec.matryoshka_dimensions == ()
    for dims in (1, 16, 63, 64):  # 64: the hidden size, the whole vector
        outs = llm.embed(PROMPTS, PoolingParams(dimensions=dims))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            got = torch.tensor(out.embedding)
            assert got.shape == (dims,)
            torch.testing.assert_close(got, cut(random_llama_hf, prompt, dims), atol=1e-5,
                                       rtol=1e-5)
    # Unnormalized: the raw leading values.
    [raw] = llm.embed(PROMPTS[:1], PoolingParams(dimensions=8, normalize=False))
    torch.testing.assert_close(torch.tensor(raw.embedding),
                               random_llama_hf.hidden_states(PROMPTS[0])[-1][:8],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions: .*1\.\.64 values .* not 65"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=65))
    assert_no_leaks(llm.engine)


def test_listed_sizes_only(random_llama_dir, random_llama_hf) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_llama_dir), dtype="float32",
              hf_overrides={"matryoshka_dimensions": [32, 16]})
    assert llm.engine.spec.matryoshka_dimensions == (16, 32)
    [out] = llm.embed(PROMPTS[:1], PoolingParams(dimensions=16))
    torch.testing.assert_close(torch.tensor(out.embedding), cut(random_llama_hf, PROMPTS[0], 16),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions: .*\[16, 32\] values .*not 24"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=24))


def test_a_model_not_trained_for_it_keeps_its_full_size(random_llama_dir) -> None:  # noqa: ANN001
    llm = LLM(model=str(random_llama_dir), dtype="float32")
    assert llm.engine.spec.matryoshka_dimensions is None
    assert len(llm.embed(PROMPTS[:1], PoolingParams(dimensions=64))[0].embedding) == 64
    with pytest.raises(ValueError, match="dimensions: .*not trained to shorten them"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=32))
    assert_no_leaks(llm.engine)


def test_pooling_params_and_spec_validate() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="dimensions must be a positive integer"):
            PoolingParams(dimensions=bad)
    with pytest.raises(ValueError, match="dimensions: task 'classify'"):
        PoolingParams(task="classify", dimensions=4)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 100}
    with pytest.raises(ValueError, match=r"matryoshka_dimensions must lie in 1..hidden_size"):
        ModelSpec.from_hf_config({**config, "matryoshka_dimensions": [128]},
                                 checkpoint_dtype="float32")
    with pytest.raises(ValueError, match="matryoshka_dimensions must be a list of integers"):
        ModelSpec.from_hf_config({**config, "matryoshka_dimensions": ["32"]},
                                 checkpoint_dtype="float32")


def test_hf_overrides_replace_config_fields(random_llama_dir) -> None:  # noqa: ANN001
    # A top-level field: the context length the engine serves follows it.
    llm = LLM(model=str(random_llama_dir), dtype="float32",
              hf_overrides={"max_position_embeddings": 96})
    assert llm.engine.max_model_len == 96
    with pytest.raises(ValueError, match="hf_overrides: .* is a GGUF file"):
        LLM(model="smollm2-135m", hf_overrides={"is_matryoshka": True})
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM(model=str(random_llama_dir), hf_overrides='{"is_matryoshka": true}')


def test_the_flag_takes_a_json_object() -> None:
    args = build_parser().parse_args(["serve", "--hf-overrides", '{"is_matryoshka": true}'])
    assert args.hf_overrides == {"is_matryoshka": True}
    for bad in ('{"is_matryoshka": tru', "[1, 2]"):
        proc = subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", "serve",
                               "--hf-overrides", bad], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr  # argparse's usage error, nothing loaded
        assert "--hf-overrides" in proc.stderr and repr(bad) in proc.stderr
