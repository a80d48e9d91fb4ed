"""Edge cases of the pooling routes (/v1/embeddings, /v1/score, /v1/rerank) against real
`argosy serve` processes: a request with more inputs than the server admits at once, the
request deadline across its slices, a client that leaves. References: the offline `LLM`
(float32, as test_embeddings_api.py)."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import torch
from openai import OpenAI
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts an `argosy serve` process

REQUEST_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def tight_server():
    """A production-like bound: 4 running, 2 waiting; so an idle server admits 6 requests."""
    proc = ServerProcess("--max-num-seqs", "4", "--max-waiting", "2",
                         "--request-timeout", str(REQUEST_TIMEOUT_S))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _wait_until_idle(server: ServerProcess, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        state = (m["argosy:num_requests_running"], m["argosy:num_requests_waiting"],
                 m["argosy:kv_cache_usage_perc"])
        if state == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert state == (0, 0, 0), f"(running, waiting, kv) still {state}"


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_more_inputs_than_the_waiting_queue_holds_are_served(tight_server: ServerProcess,
                                                             offline_llm) -> None:  # noqa: ANN001
    # 20 inputs on an idle server that admits 6 requests at once: served in slices, never
    # a 429 (which no retry could get past: the request alone overflows the queue).
    texts = [f"item number {i}" for i in range(20)]
    expected = [e.embedding for e in offline_llm.embed(texts)]
    client = OpenAI(base_url=tight_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(20))
    for d, e in zip(reply.data, expected, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(e),
                                   atol=1e-5, rtol=1e-5)
    # /v1/rerank runs its texts the same way: the query and 20 documents.
    [query] = [e.embedding for e in offline_llm.embed(["which item is number 7?"])]
    resp = httpx.post(tight_server.url + "/v1/rerank", timeout=60, json={
        "query": "which item is number 7?", "documents": texts, "return_documents": False})
    assert resp.status_code == 200, resp.text
    want = [_cosine(query, e) for e in expected]
    results = resp.json()["results"]
    assert sorted(r["index"] for r in results) == list(range(20))
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)


def test_the_request_timeout_bounds_the_whole_request(tight_server: ServerProcess) -> None:
    # 600 inputs of ~60 tokens run in 100 slices, each well within --request-timeout, all
    # together far beyond it: a 408 at the deadline, not a reply long after it.
    texts = ["word " * 60 + str(i) for i in range(600)]
    start = time.monotonic()
    resp = httpx.post(tight_server.url + "/v1/embeddings", json={"input": texts}, timeout=300)
    elapsed = time.monotonic() - start
    assert resp.status_code == 408, (resp.status_code, elapsed)
    assert resp.json()["error"]["code"] == "request_timeout"
    assert elapsed < REQUEST_TIMEOUT_S + 5, elapsed
    # The slice running at the deadline was aborted (once the engine's step in flight ends):
    # nothing runs or waits, no KV block is held, and the next request is served.
    _wait_until_idle(tight_server, within=15)
    ok = httpx.post(tight_server.url + "/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": ["word " * 400 + str(i) for i in range(600)]}),
    ("/v1/rerank", {"query": "q", "documents": ["word " * 400 + str(i) for i in range(600)]}),
])
def test_a_client_leaving_mid_request_frees_everything(server: ServerProcess, path: str,
                                                       body: dict) -> None:
    _, idle_kv = server.running_and_kv()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + path, json=body, timeout=2)
    server.assert_back_to_idle(idle_kv, within=30)
    ok = httpx.post(server.url + "/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_more_completion_prompts_than_the_server_admits_is_a_400(
        tight_server: ServerProcess) -> None:
    # A completion's prompts run together (one batch), so 7 prompts can never be admitted by
    # a server that holds 6 requests: a 429 would ask for retries that cannot succeed.
    body = {"model": MODEL, "prompt": [f"Story {i}:" for i in range(7)], "max_tokens": 2}
    resp = httpx.post(tight_server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and "at most 6" in error["message"], error
    body["prompt"] = body["prompt"][:6]  # what fits is served
    resp = httpx.post(tight_server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 6
