"""Fixtures shared by the quantization tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: model_factory
sys.path.insert(0, str(Path(__file__).parent))  # prequant_factory


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random float checkpoint to quantize. qwen2: q/k/v carry biases, which must
    survive next to the quantized weights."""
    from model_factory import make_random_model_dir

    return make_random_model_dir(tmp_path_factory.mktemp("float"), "qwen2", hidden_size=96,
                                 intermediate_size=160, num_attention_heads=3,
                                 num_key_value_heads=1, init_std=0.1)
