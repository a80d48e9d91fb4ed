"""`argosy serve --speculative ...`: speculation runs behind the HTTP server and its counters
reach /metrics."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from serve_harness import ServerProcess  # noqa: E402

PASSAGE = ("The Apollo program was the third United States human spaceflight program carried "
           "out by NASA, which succeeded in landing the first humans on the Moon from 1968 to 1972.")


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ServerProcess]:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    # One intra-op thread: the embedded model decodes ~10x faster that way on a shared CPU.
    proc = ServerProcess("--speculative", spec, "--drain-timeout", "5",
                         env={"OMP_NUM_THREADS": "1"})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_speculative_server_reports_draft_and_accepted_tokens(spec_server: ServerProcess) -> None:
    before = spec_server.metrics()
    body = {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": f"Copy this text exactly:\n\n{PASSAGE}"}]}
    r = httpx.post(spec_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "Apollo program" in text  # the model copies the passage, so drafts get accepted
    after = spec_server.metrics()
    drafted = (after["argosy:spec_decode_num_draft_tokens_total"]
               - before.get("argosy:spec_decode_num_draft_tokens_total", 0))
    accepted = (after["argosy:spec_decode_num_accepted_tokens_total"]
                - before.get("argosy:spec_decode_num_accepted_tokens_total", 0))
    assert 0 < accepted <= drafted
    # Accepted drafts count as generated tokens exactly once (no double counting on verify).
    assert after["argosy:generation_tokens_total"] - before["argosy:generation_tokens_total"] \
        == r.json()["usage"]["completion_tokens"]
