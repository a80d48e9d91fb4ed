"""The embedded model's checkpoint and a grammar compiler on its real tokenizer."""

from __future__ import annotations

import pytest
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.structured_output.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def checkpoint():  # noqa: ANN201
    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="module")
def compiler(checkpoint) -> GrammarCompiler:  # noqa: ANN001
    return GrammarCompiler(checkpoint.tokenizer, checkpoint.spec.vocab_size,
                           checkpoint.tokenizer.eos_token_ids)
