"""Pooling routes (/v1/embeddings, /v1/score, /v1/rerank) served in-process (build_app over
a small random model, no `argosy serve` process to start)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from argosy_runtime import LLM, LLMEngine, PoolingParams
from argosy_runtime.server.app import build_app
from argosy_runtime.server.config import ServerConfig
from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_random_model_dir  # noqa: E402

TEXTS = ["Hello there, general", "x"]


@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A headless model whose weights are so large that its activations overflow float32:
    what a float16 model whose activations outgrow float16's range gives."""
    return make_random_model_dir(tmp_path_factory.mktemp("models"), "mistral",
                                 num_hidden_layers=2, headless=True, init_std=1e18)


@pytest.fixture(scope="module")
def overflowing(overflowing_model: Path) -> Iterator[TestClient]:
    engine = LLMEngine(model=str(overflowing_model), dtype="float32", max_model_len=256)
    with TestClient(build_app(engine, ServerConfig()), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": TEXTS, "encoding_format": "float"}),
    ("/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}),
    ("/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS}),
    ("/v1/rerank", {"query": TEXTS[0], "documents": TEXTS}),
])
def test_nan_outputs_are_a_clear_error_not_an_opaque_500_or_nan_bytes(
        overflowing: TestClient, path: str, body: dict) -> None:
    resp = overflowing.post(path, json=body)
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert error["code"] == "non_finite_output", error
    assert "NaN" in error["message"] and "float32" in error["message"], error
    # The server goes on serving.
    assert overflowing.get("/health").status_code == 200


def test_the_overflowing_model_really_gives_nan(overflowing_model: Path) -> None:
    # Else the test above would prove nothing.
    [out] = LLM(model=str(overflowing_model), dtype="float32").embed([TEXTS[0]], PoolingParams())
    assert any(v != v for v in out.embedding)  # NaN


@pytest.mark.parametrize("too_long", ["word " * 3000, list(range(100, 400))])
def test_an_overlong_input_of_a_batch_is_named_by_its_index(overflowing: TestClient,
                                                            too_long: str | list[int]) -> None:
    # Among a thousand inputs, "the prompt has 300 tokens" left the client to find which.
    resp = overflowing.post("/v1/embeddings", json={"input": ["fine", "also fine", too_long]
                                                    if isinstance(too_long, str) else
                                                    [[1, 2], [3], too_long]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error
    assert "input[2] has" in error["message"], error
    # one input alone is still "the prompt"
    resp = overflowing.post("/v1/embeddings", json={"input": too_long})
    assert "the prompt has" in resp.json()["error"]["message"], resp.text
