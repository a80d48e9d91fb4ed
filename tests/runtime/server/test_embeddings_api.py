"""POST /v1/embeddings through the official `openai` client and raw HTTP, against a real
`argosy serve` (float32, so its vectors equal the offline `LLM.embed` ones)."""

from __future__ import annotations

import base64
import io
import json
import struct
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from argosy_runtime import PoolingParams, SamplingParams
from openai import OpenAI
from serve_harness import MODEL, ServerProcess, wait_for_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]
HIDDEN_SIZE = 576  # SmolLM2-135M


def assert_vectors_equal(got: list[float], expected: list[float] | None) -> None:
    assert expected is not None and len(got) == len(expected) == HIDDEN_SIZE
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_openai_client_gets_the_offline_vectors(client: OpenAI, offline_llm) -> None:
    # The client asks for base64 unless told otherwise, and decodes it.
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    expected = offline_llm.embed(TEXTS)
    assert reply.model == MODEL and reply.object == "list"
    assert [d.index for d in reply.data] == [0, 1, 2]
    for d, e in zip(reply.data, expected):
        assert_vectors_equal(d.embedding, e.embedding)
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens
    # Normalized, and different inputs differ.
    assert abs(torch.tensor(reply.data[0].embedding).norm().item() - 1) < 1e-5
    assert reply.data[0].embedding != reply.data[1].embedding


def test_float_and_base64_formats_carry_the_same_numbers(http: httpx.Client) -> None:
    floats = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"})
    packed = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert floats.status_code == packed.status_code == 200, (floats.text, packed.text)
    vector = floats.json()["data"][0]["embedding"]
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert len(raw) == 4 * HIDDEN_SIZE
    assert list(struct.unpack(f"<{HIDDEN_SIZE}f", raw)) == vector  # float32 round trip


def test_token_id_inputs(client: OpenAI, offline_llm) -> None:
    ids = offline_llm.get_tokenizer().encode(TEXTS[0])
    [expected] = offline_llm.embed([ids])
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert_vectors_equal(one.data[0].embedding, expected.embedding)
    assert_vectors_equal(many.data[0].embedding, expected.embedding)
    assert_vectors_equal(many.data[1].embedding, offline_llm.embed([ids[:3]])[0].embedding)
    assert one.usage.prompt_tokens == len(ids)


def test_dimensions_equal_to_the_hidden_size_is_accepted(http: httpx.Client) -> None:
    ok = http.post("/v1/embeddings", json={"input": "Hi", "dimensions": HIDDEN_SIZE,
                                           "encoding_format": "float"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == HIDDEN_SIZE


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["fine", ""]}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [1, 99999999]}, 400, "input"),
    ({"input": [True]}, 400, "input"),  # not token id 1
    ({"input": [[1.0]]}, 400, "input"),
    ({"input": "Hi", "dimensions": True}, 400, "dimensions"),
    ({"input": "word " * 3000}, 400, "input"),  # > --max-model-len 2048
    ({"input": ["x"] * 2049}, 400, "input"),
    ({"input": "Hi", "dimensions": 64}, 400, "dimensions"),
    ({"input": "Hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "Hi", "pooling": "mean"}, 400, "pooling"),
    ({"input": "Hi", "model": "nope"}, 404, "model"),
    ({}, 400, "input"),
])
def test_bad_requests_are_4xx_naming_the_field(http: httpx.Client, body, status: int,  # noqa: ANN001
                                               param: str) -> None:
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


def test_context_length_error_has_its_code(http: httpx.Client) -> None:
    resp = http.post("/v1/embeddings", json={"input": "word " * 3000})
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client, offline_llm) -> None:
    ids = offline_llm.get_tokenizer().encode(TEXTS[0])
    k = 4
    r = http.post("/v1/embeddings", json={"input": [TEXTS[0], TEXTS[2]], "encoding_format": "float",
                                          "truncate_prompt_tokens": k})
    assert r.status_code == 200, r.text
    [cut] = offline_llm.embed([ids[-k:]])
    [short] = offline_llm.embed([TEXTS[2]])  # shorter than k: left whole
    data = r.json()["data"]
    assert_vectors_equal(data[0]["embedding"], cut.embedding)
    assert_vectors_equal(data[1]["embedding"], short.embedding)
    assert r.json()["usage"]["prompt_tokens"] == k + len(short.prompt_token_ids)
    # -1: as much as the model holds, so a text past --max-model-len (a 400 without it) fits.
    long = http.post("/v1/embeddings", json={"input": "word " * 3000, "truncate_prompt_tokens": -1})
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] == 2048
    for bad in (-2, 2049, True, "4"):
        r = http.post("/v1/embeddings", json={"input": "Hi", "truncate_prompt_tokens": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_more_inputs_than_one_slice_come_back_in_order(client: OpenAI, offline_llm) -> None:
    # 300 inputs: more than the 256 one request admits to the engine at a time.
    inputs = [f"item number {i}" for i in range(300)]
    reply = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(300))
    for i in (0, 255, 256, 299):
        [expected] = offline_llm.embed([inputs[i]])
        assert_vectors_equal(reply.data[i].embedding, expected.embedding)


def test_embeddings_beside_a_running_generation(client: OpenAI, offline_llm) -> None:
    prompt = "The three primary colors are"
    expected = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
    vectors: list = []

    def embed_while_generating() -> None:
        for _ in range(4):
            vectors.append(client.embeddings.create(model=MODEL, input=TEXTS,
                                                    encoding_format="float"))

    thread = threading.Thread(target=embed_while_generating)
    thread.start()
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                     temperature=0).choices[0].text
    thread.join()
    assert text == expected.outputs[0].text
    first = offline_llm.embed(TEXTS)
    for reply in vectors:
        for d, e in zip(reply.data, first):
            assert_vectors_equal(d.embedding, e.embedding)


@pytest.fixture(scope="module")
def mean_server():
    proc = ServerProcess("--embedding-pooling", "mean", "--api-key", "sekret")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_mean_pooling_server_with_an_api_key(mean_server: ServerProcess, offline_llm) -> None:
    denied = httpx.post(mean_server.url + "/v1/embeddings", json={"input": "Hi"}, timeout=60)
    assert denied.status_code == 401
    client = OpenAI(base_url=mean_server.url + "/v1", api_key="sekret", max_retries=0)
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    for d, e in zip(reply.data, offline_llm.embed(TEXTS, PoolingParams(pooling="mean"))):
        assert_vectors_equal(d.embedding, e.embedding)
    # Not the last-token vector: the flag really changed the pooling.
    last = offline_llm.embed(TEXTS[:1])[0].embedding
    assert (torch.tensor(reply.data[0].embedding) - torch.tensor(last)).abs().max() > 1e-2


@pytest.fixture(scope="module")
def headless_server(tmp_path_factory: pytest.TempPathFactory):
    # A folder saved as transformers' MistralModel (no lm_head), as e5-mistral is published.
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "mistral",
                                   num_hidden_layers=2, headless=True)
    # Marked Matryoshka-trained the way vLLM users mark Qwen3-Embedding: --hf-overrides.
    proc = ServerProcess("--model", str(folder), "--served-model-name", "embedder",
                         "--hf-overrides", '{"is_matryoshka": true}')
    try:
        yield proc.wait_ready(), folder
    finally:
        proc.stop()


def test_a_headless_checkpoint_serves_embeddings_and_refuses_generation(headless_server) -> None:  # noqa: ANN001
    from argosy_runtime import LLM

    server, folder = headless_server
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model="embedder", input=TEXTS)
    offline = LLM(model=str(folder), dtype="float32").embed(TEXTS)
    for d, e in zip(reply.data, offline):
        assert len(d.embedding) == len(e.embedding) == 64
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(e.embedding),
                                   atol=1e-5, rtol=1e-5)
    resp = httpx.post(server.url + "/v1/completions",
                      json={"model": "embedder", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "model" and "serves embeddings only" in error["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_matryoshka_dimensions_cut_the_vector(headless_server) -> None:  # noqa: ANN001
    from argosy_runtime import LLM, PoolingParams

    server, folder = headless_server
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    offline = LLM(model=str(folder), dtype="float32", hf_overrides={"is_matryoshka": True})
    want = offline.embed(TEXTS, PoolingParams(dimensions=16))
    # The client's default request is base64, which it decodes itself.
    reply = client.embeddings.create(model="embedder", input=TEXTS, dimensions=16)
    for d, e in zip(reply.data, want, strict=True):
        assert len(d.embedding) == 16
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(e.embedding),
                                   atol=1e-5, rtol=1e-5)
    resp = httpx.post(server.url + "/v1/embeddings",
                      json={"model": "embedder", "input": "Hi", "dimensions": 65}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "dimensions"
    assert "1..64" in resp.json()["error"]["message"]


def test_a_batch_of_embeddings(client: OpenAI, offline_llm) -> None:
    # OpenAI's Batch API runs /v1/embeddings lines too (at batch priority, on the same server).
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": text, "encoding_format": "float"}}
             for i, text in enumerate(TEXTS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": MODEL, "input": ""}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    input_id = client.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    records = [json.loads(line)
               for line in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {r["custom_id"]: r["response"]["body"] for r in records}
    for i, expected in enumerate(offline_llm.embed(TEXTS)):
        assert_vectors_equal(by_id[f"e{i}"]["data"][0]["embedding"], expected.embedding)
    errors = client.files.content(batch.error_file_id).text
    assert '"bad"' in errors


def test_each_owner_has_a_prefix_cache_of_its_own_for_embeddings(
        http: httpx.Client, server: ServerProcess) -> None:
    """As for generation (test_openai_api.py): an embedding input cached for one owner (a
    gateway's tenant, `X-Argosy-Owner`) is no hit for another, so its time to answer tells
    that one nothing. Hits counted by the server's own prefix-cache counter."""
    text = "an embedding input " + "with several full blocks of tokens " * 8 + uuid.uuid4().hex

    def hits_after(owner: str) -> float:
        r = http.post("/v1/embeddings", json={"model": MODEL, "input": text},
                      headers={"X-Argosy-Owner": owner})
        assert r.status_code == 200, r.text
        return server.metrics()["argosy:prefix_cache_hits_total"]

    start = server.metrics()["argosy:prefix_cache_hits_total"]
    first = hits_after("team-a")
    assert first == start
    again = hits_after("team-a")
    assert again > first  # its own blocks, found
    assert hits_after("team-b") == again  # another owner's: not found
