"""Fixtures of the speculative-decoding tests that run tiny random models in process."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from model_factory import make_random_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models on a shared, oversubscribed CPU: intra-op threads only add synchronization
    stalls (measured 10x slower with 2 threads under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_and_copy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer random target and a copy of it as a separate draft (every draft accepted)."""
    root = tmp_path_factory.mktemp("spec")
    target = make_random_model_dir(root, "llama", num_hidden_layers=2)
    copy = root / "copy"
    shutil.copytree(target, copy)
    return {"target": target, "copy": copy}
