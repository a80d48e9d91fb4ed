"""Shared fixtures for engine tests: transformers references and tiny random models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from model_factory import (  # noqa: E402
    QWEN3_TEST_SHAPE,
    embedded_gguf_path,
    make_random_model_dir,
)


class HFReference:
    """Greedy continuations and logprobs from Hugging Face transformers (float32)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._cache: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return self._generate(prompt_ids, max_new_tokens)[0]

    @torch.no_grad()
    def greedy_logprobs(self, prompt_ids: list[int], max_new_tokens: int) -> list[torch.Tensor]:
        """log_softmax of the logits at each generated position: [vocab] tensors."""
        return self._generate(prompt_ids, max_new_tokens)[1]

    @torch.no_grad()
    def prompt_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
        logits = self.model(torch.tensor([prompt_ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1)

    @torch.no_grad()
    def hidden_states(self, prompt_ids: list[int]) -> torch.Tensor:
        """[len(prompt), hidden]: the base model's last_hidden_state (after the final norm),
        what embeddings are pooled from."""
        return self.model.model(torch.tensor([prompt_ids])).last_hidden_state[0].float()

    def _generate(self, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding with transformers' own forward and KV cache, step by step.

        (generate()'s min_new_tokens would mask EOS, which ignore_eos does not do.)
        """
        key = (tuple(prompt_ids), n)
        if key not in self._cache:
            ids, logprobs = [], []
            out = self.model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(n):
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(lp.argmax())
                ids.append(token)
                logprobs.append(lp)
                out = self.model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                                 use_cache=True)
            self._cache[key] = (ids, logprobs)
        return self._cache[key]


def _load_hf(path: Path, gguf: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if gguf:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    return embedded_gguf_path()


@pytest.fixture(scope="session")
def embedded_hf(embedded_path: Path) -> HFReference:
    return HFReference(_load_hf(embedded_path, gguf=True))


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("models"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="session")
def random_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("models"), "qwen2", num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def random_llama_hf(random_llama_dir: Path) -> HFReference:
    return HFReference(_load_hf(random_llama_dir))


@pytest.fixture(scope="session")
def random_qwen2_hf(random_qwen2_dir: Path) -> HFReference:
    return HFReference(_load_hf(random_qwen2_dir))



@pytest.fixture(scope="module")
def random_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("models"), "qwen3", **QWEN3_TEST_SHAPE)


@pytest.fixture(scope="module")
def random_qwen3_hf(random_qwen3_dir: Path) -> HFReference:
    return HFReference(_load_hf(random_qwen3_dir))


@pytest.fixture(scope="session")
def hf_reference():  # -> Callable[[Path], HFReference]
    """Builds the transformers reference (float32) of any model folder a test writes."""
    return lambda path: HFReference(_load_hf(Path(path)))
