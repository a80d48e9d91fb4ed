"""POST /v1/score and /v1/rerank (vLLM's scoring APIs for embedding models) over raw HTTP,
against a real `argosy serve`: every score is the cosine of the vectors /v1/embeddings
returns for the same texts."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import wait_for_batch
from test_fuzz import JUNK, strategy_for

pytestmark = pytest.mark.slow  # starts an `argosy serve` process

QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
        "Horses and cows are both animals", "Paris is in France."]


def vectors(http: httpx.Client, inputs: list) -> list[list[float]]:
    resp = http.post("/v1/embeddings", json={"input": inputs, "encoding_format": "float"})
    assert resp.status_code == 200, resp.text
    return [d["embedding"] for d in resp.json()["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def prompt_tokens(http: httpx.Client, texts: list[str]) -> int:
    resp = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
    return resp.json()["usage"]["prompt_tokens"]


def score(http: httpx.Client, body: dict, path: str = "/v1/score") -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_offline_llm_score_equals_the_server(http: httpx.Client, offline_llm) -> None:  # noqa: ANN001
    # LLM.score and /v1/score are one function (scoring.py): same pairing, same cosines.
    served = score(http, {"text_1": QUERY, "text_2": DOCS})
    assert offline_llm.score(QUERY, DOCS) == pytest.approx(
        [d["score"] for d in served["data"]], abs=1e-5)
    pairs = {"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[2], DOCS[3]]}
    assert offline_llm.score(pairs["text_1"], pairs["text_2"]) == pytest.approx(
        [d["score"] for d in score(http, pairs)["data"]], abs=1e-5)
    for bad in (([QUERY, DOCS[0]], DOCS[:3]), ([], DOCS)):
        with pytest.raises(ValueError, match="text_"):
            offline_llm.score(*bad)


def test_one_to_one_one_to_n_and_n_to_n_are_cosines_of_the_embeddings(
        http: httpx.Client) -> None:
    q, *docs = vectors(http, [QUERY, *DOCS])
    one = score(http, {"model": "smollm2-135m", "text_1": QUERY, "text_2": DOCS[1]})
    assert one["object"] == "list" and one["model"] == "smollm2-135m"
    assert one["id"].startswith("score-") and isinstance(one["created"], int)
    assert one["data"] == [{"index": 0, "object": "score", "score": pytest.approx(
        cosine(q, docs[1]), abs=1e-5)}]
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] == prompt_tokens(
        http, [QUERY, DOCS[1]])

    many = score(http, {"text_1": [QUERY], "text_2": DOCS})  # a one-item list is 1-to-N too
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
    for d, doc in zip(many["data"], docs, strict=True):
        assert d["score"] == pytest.approx(cosine(q, doc), abs=1e-5)
    # The query is embedded once, not once per document.
    assert many["usage"]["prompt_tokens"] == prompt_tokens(http, [QUERY, *DOCS])

    pairs = score(http, {"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], DOCS[2]]})
    assert [d["score"] for d in pairs["data"]] == [
        pytest.approx(cosine(q, docs[1]), abs=1e-5),
        pytest.approx(cosine(docs[0], docs[2]), abs=1e-5)]
    # Not the same number twice: the pairs really differ.
    assert abs(pairs["data"][0]["score"] - pairs["data"][1]["score"]) > 1e-4


def test_a_text_in_several_pairs_is_counted_once_and_scores_one_with_itself(
        http: httpx.Client) -> None:
    reply = score(http, {"text_1": [QUERY, QUERY, DOCS[0]], "text_2": [QUERY, DOCS[0], QUERY]})
    assert reply["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert reply["data"][1]["score"] == pytest.approx(reply["data"][2]["score"], abs=1e-6)
    assert reply["usage"]["prompt_tokens"] == prompt_tokens(http, [QUERY, DOCS[0]])


def test_the_legacy_path_answers_the_same(http: httpx.Client) -> None:
    body = {"text_1": QUERY, "text_2": DOCS}
    scores = [d["score"] for d in score(http, body)["data"]]
    legacy = [d["score"] for d in score(http, body, "/score")["data"]]
    assert legacy == pytest.approx(scores, abs=1e-6)


def test_rerank_sorts_by_relevance_and_keeps_the_documents(http: httpx.Client) -> None:
    q, *docs = vectors(http, [QUERY, *DOCS])
    expected = [cosine(q, d) for d in docs]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    reply = http.post("/v1/rerank", json={"model": "smollm2-135m", "query": QUERY,
                                          "documents": DOCS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("rerank-") and body["model"] == "smollm2-135m"
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["usage"]["total_tokens"] == prompt_tokens(http, [QUERY, *DOCS])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_top_n_and_return_documents(http: httpx.Client, path: str) -> None:
    full = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    resp = http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                 "return_documents": False})
    assert resp.status_code == 200, resp.text
    top = resp.json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all("document" not in r for r in top)
    # top_n 0 (vLLM's default) and more than the documents: every document.
    for n in (0, 10):
        got = http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": n}).json()
        assert len(got["results"]) == len(DOCS)


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client) -> None:
    long_text = "word " * 3000 + "The capital of France is Paris."  # > --max-model-len 2048
    ids = http.post("/tokenize", json={"prompt": long_text}).json()["tokens"]
    [q], [tail] = vectors(http, [QUERY]), vectors(http, [ids[-16:]])
    reply = score(http, {"text_1": QUERY, "text_2": long_text, "truncate_prompt_tokens": 16})
    assert reply["data"][0]["score"] == pytest.approx(cosine(q, tail), abs=1e-5)
    # -1: the model's maximum length.
    reply = score(http, {"text_1": QUERY, "text_2": long_text, "truncate_prompt_tokens": -1})
    assert len(reply["data"]) == 1


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/score", {"text_1": [], "text_2": "x"}, 400, "text_1"),
    ("/v1/score", {"text_1": "x", "text_2": []}, 400, "text_2"),
    ("/v1/score", {"text_1": "", "text_2": "x"}, 400, "text_1"),
    ("/v1/score", {"text_1": "x", "text_2": ["ok", ""]}, 400, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, 400, "text_2"),  # N-to-1
    ("/v1/score", {"text_1": "x", "text_2": "word " * 3000}, 400, "text_2"),
    ("/v1/score", {"text_1": "x", "text_2": ["y"] * 2049}, 400, "text_2"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": 4096}, 400,
     "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": "x"}, 400, "text_2"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "encoding_format": "float"}, 400,
     "encoding_format"),
    ("/v1/score", {"text_1": "x", "text_2": "y", "model": "nope"}, 404, "model"),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": "one string"}, 400, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, 400, "query"),
    ("/v1/rerank", {"query": "word " * 3000, "documents": ["d"]}, 400, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "return_documents": "maybe"}, 400,
     "return_documents"),
    ("/v2/rerank", {"documents": ["d"]}, 400, "query"),
    ("/v2/rerank", {"query": "q", "documents": ["d"], "model": "nope"}, 404, "model"),
])
def test_bad_requests_are_4xx_naming_the_field(http: httpx.Client, path: str, body: dict,
                                               status: int, param: str) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


def test_too_long_a_text_has_the_context_length_code(http: httpx.Client) -> None:
    resp = http.post("/v1/score", json={"text_1": "x", "text_2": "word " * 3000})
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_the_routes_have_their_own_http_metric_label(http: httpx.Client) -> None:
    for path in ("/v1/score", "/score"):
        http.post(path, json={"text_1": "x", "text_2": "y"})
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        http.post(path, json={"query": "x", "documents": ["y"]})
    text = http.get("/metrics").text
    for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        assert f'path="{path}",status="200"' in text, path


@pytest.fixture(scope="module")
def openapi(http: httpx.Client) -> dict[str, Any]:
    return http.get("/openapi.json").json()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_schema_fuzz_never_5xx(http: httpx.Client, openapi: dict[str, Any], data) -> None:  # noqa: ANN001
    """Bodies drawn from the routes' own schema (mostly well typed, some junk): never a 5xx,
    and every error has the OpenAI shape."""
    path = data.draw(st.sampled_from(["/v1/score", "/v1/rerank"]))
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = data.draw(st.one_of(*[strategy_for(ref, openapi)] * 4, JUNK))
    r = http.post(path, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


@pytest.mark.parametrize(("endpoint", "body"), [
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
])
def test_a_batch_answers_what_the_live_endpoint_answers(client, http: httpx.Client,  # noqa: ANN001
                                                        endpoint: str, body: dict) -> None:
    """The Batch API runs /v1/score and /v1/rerank lines too (as vLLM's run_batch does)."""
    lines = [{"custom_id": "ok", "method": "POST", "url": endpoint, "body": body},
             {"custom_id": "bad", "method": "POST", "url": endpoint, "body": {**body, "model": "nope"}}]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    input_id = client.files.create(file=("s.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=input_id, endpoint=endpoint,
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [record] = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    live = score(http, body, endpoint)
    batched = record["response"]["body"]
    for answer in (batched, live):  # ids and times differ; scores to rounding (batch shapes)
        answer.pop("id"), answer.pop("created", None)
        for item in answer.get("data") or answer["results"]:
            key = "score" if "score" in item else "relevance_score"
            item[key] = pytest.approx(item[key], abs=1e-5) if answer is live else item[key]
    assert batched == live
    assert '"bad"' in client.files.content(batch.error_file_id).text
