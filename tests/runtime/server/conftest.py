"""Fixtures: real `argosy serve` processes on loopback ports, shared by many tests.

The main server runs the embedded smollm2-135m in float32 so that its greedy texts equal the
offline `LLM.generate` texts. Loading the model takes tens of seconds on a shared CPU, so each
server is started once per session (or module) and shared.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serve_harness import MODEL, ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared server: float32, no auth, default queue bound, Hermes tool-call parsing."""
    proc = ServerProcess("--drain-timeout", "5", "--tool-call-parser", "hermes")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def offline_llm(server: ServerProcess):
    """The offline `LLM` on the same model and dtype (loaded after the server started, so the
    two loads overlap)."""
    from argosy_runtime import LLM

    return LLM(model=MODEL, dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)
