"""Encoder-only models behind a real `argosy serve` (float32): a BERT sentence-transformers
embedding model on /v1/embeddings (the official openai client) and /v1/score, a BERT and an
XLM-RoBERTa cross-encoder on /v1/rerank and /v1/score; references from transformers in this
process. Generation and too-long inputs are 400s."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from encoder_factory import encode, load_hf, make_encoder_dir  # noqa: E402
from st_pooling_reference import st_pool  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

TEXTS = ["the cat sat on the mat", "hello", "what is the capital of france? paris is the city"]
QUERY = "what is the capital of france"
DOCS = ["a dog sat on the mat", "paris is the capital of france", "berlin"]


def _serve(folder: Path) -> ServerProcess:
    return ServerProcess("--model", str(folder), "--served-model-name", "enc",
                         "--max-model-len", "60").wait_ready()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoder-api")


@pytest.fixture(scope="module")
def embedder(tmp: Path):  # -> (server, folder)
    folder = make_encoder_dir(tmp, "bert", pooling="mean")
    server = _serve(folder)
    yield server, folder
    server.stop()


@torch.no_grad()
def _reference_embedding(hf, folder: Path, text: str) -> torch.Tensor:  # noqa: ANN001
    ids, types = encode(folder, text)
    hidden = hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).last_hidden_state[0]
    return F.normalize(hidden.mean(dim=0), dim=0)


@torch.no_grad()
def _reference_score(hf, folder: Path, text: str, pair: str) -> float:  # noqa: ANN001
    ids, types = encode(folder, text, pair)
    logits = hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits
    return torch.sigmoid(logits[0, 0]).item()


def test_embeddings_with_the_openai_client(embedder) -> None:  # noqa: ANN001
    server, folder = embedder
    hf = load_hf(folder)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    reply = client.embeddings.create(model="enc", input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == sum(len(encode(folder, t)[0]) for t in TEXTS)
    for text, item in zip(TEXTS, reply.data, strict=True):
        torch.testing.assert_close(torch.tensor(item.embedding),
                                   _reference_embedding(hf, folder, text), atol=1e-5, rtol=1e-5)
    # /v1/score on an embedding model: the cosine of the two embeddings.
    r = httpx.post(server.url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[2]},
                   timeout=60)
    assert r.status_code == 200, r.text
    cosine = F.cosine_similarity(_reference_embedding(hf, folder, TEXTS[0]),
                                 _reference_embedding(hf, folder, TEXTS[2]), dim=0).item()
    assert r.json()["data"][0]["score"] == pytest.approx(cosine, abs=1e-5)


def test_errors(embedder) -> None:  # noqa: ANN001
    server, _ = embedder
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "enc", "prompt": "hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert "embeddings only" in r.text
    r = httpx.post(server.url + "/v1/embeddings",
                   json={"model": "enc", "input": "hello " * 80}, timeout=60)
    assert r.status_code == 400, r.text
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "enc", "messages": [{"role": "user", "content": "hi"}]},
                   timeout=60)
    assert r.status_code == 400, r.text
    # Still serving afterwards.
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "enc", "input": "hello"},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_truncation_too_small_for_an_encoder_is_a_400(embedder) -> None:  # noqa: ANN001
    """transformers' tokenizer(text, truncation=True, max_length=k) (vLLM's cut) keeps [CLS]
    and [SEP]: k = 2 leaves nothing of the text (two long texts would score exactly 1.0),
    k = 1 cannot even hold them (it leaves the text whole). Those k are a 400; from k = 3 on
    the cut is transformers'."""
    from transformers import AutoTokenizer

    server, folder = embedder
    hf, tok = load_hf(folder), AutoTokenizer.from_pretrained(str(folder))
    long_1, long_2 = TEXTS[0] + " " + TEXTS[2], TEXTS[2] + " " + TEXTS[1]
    assert tok(long_1, truncation=True, max_length=2)["input_ids"] == [
        tok.cls_token_id, tok.sep_token_id]
    assert tok(long_1, truncation=True, max_length=1)["input_ids"] == tok(long_1)["input_ids"]
    for k in (1, 2):
        for path, body in (("/v1/score", {"text_1": long_1, "text_2": long_2}),
                           ("/v1/rerank", {"query": long_1, "documents": [long_2]})):
            r = httpx.post(server.url + path, json={"model": "enc", **body,
                                                    "truncate_prompt_tokens": k}, timeout=60)
            assert r.status_code == 400, (path, k, r.text)
            error = r.json()["error"]
            assert error["param"] == "truncate_prompt_tokens", error
            assert "at least 3" in error["message"], error

    @torch.no_grad()
    def truncated_embedding(text: str, k: int) -> torch.Tensor:
        enc = tok(text, truncation=True, max_length=k, return_tensors="pt")
        return F.normalize(hf(**enc).last_hidden_state[0].mean(dim=0), dim=0)

    r = httpx.post(server.url + "/v1/score", json={
        "model": "enc", "text_1": long_1, "text_2": long_2, "truncate_prompt_tokens": 3},
        timeout=60)
    assert r.status_code == 200, r.text
    want = F.cosine_similarity(truncated_embedding(long_1, 3), truncated_embedding(long_2, 3),
                               dim=0).item()
    assert r.json()["data"][0]["score"] == pytest.approx(want, abs=1e-5)
    assert want < 1 - 1e-4  # one token of each text is left: different texts, different scores
    # /v1/embeddings cuts the same way, and refuses the same k.
    r = httpx.post(server.url + "/v1/embeddings", json={
        "model": "enc", "input": [long_1, long_2], "truncate_prompt_tokens": 5,
        "encoding_format": "float"}, timeout=60)
    assert r.status_code == 200, r.text
    for text, item in zip((long_1, long_2), r.json()["data"], strict=True):
        torch.testing.assert_close(torch.tensor(item["embedding"]), truncated_embedding(text, 5),
                                   atol=1e-5, rtol=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == 10
    r = httpx.post(server.url + "/v1/embeddings", json={
        "model": "enc", "input": long_1, "truncate_prompt_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@torch.no_grad()
def test_embedding_pooling_flag(embedder) -> None:  # noqa: ANN001
    """--embedding-pooling cls on an encoder whose own pooling is mean (the flag takes every
    PoolingParams pooling: the engine tests check sentence-transformers' modes); a pooling the
    model cannot take (cls on a decoder) stops `argosy serve` with exit status 2 before it
    serves."""
    from argosy_runtime import EngineArgs
    from argosy_runtime.cli.serve import serve
    from argosy_runtime.server.config import ServerConfig
    from model_factory import make_random_model_dir

    _, folder = embedder
    hf = load_hf(folder)
    server = ServerProcess("--model", str(folder), "--served-model-name", "enc",
                           "--max-model-len", "60", "--embedding-pooling", "cls").wait_ready()
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    for text, d in zip(TEXTS, r.json()["data"], strict=True):
        ids = torch.tensor([encode(folder, text)[0]])
        want = st_pool(hf(ids).last_hidden_state, torch.ones_like(ids), "cls")[0]
        torch.testing.assert_close(torch.tensor(d["embedding"]), F.normalize(want, dim=0),
                                   atol=1e-5, rtol=1e-5)
    decoder = make_random_model_dir(folder.parent / "decoder", "llama", num_hidden_layers=1)
    assert serve(EngineArgs(model=str(decoder), dtype="float32"),
                 ServerConfig(embedding_pooling="cls")) == 2


@pytest.mark.parametrize("arch", ["bert", "xlm_roberta"])
def test_rerank_cross_encoder(tmp: Path, arch: str) -> None:
    folder = make_encoder_dir(tmp, arch, classifier=True, seed=7)
    hf = load_hf(folder)
    expected = [_reference_score(hf, folder, QUERY, d) for d in DOCS]
    server = _serve(folder)
    try:
        r = httpx.post(server.url + "/v1/rerank",
                       json={"model": "enc", "query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -expected[i])
        for x in results:
            assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-6)
            assert x["document"]["text"] == DOCS[x["index"]]
        r = httpx.post(server.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected, abs=1e-6)
        # truncate_prompt_tokens cuts a pair as transformers' tokenizer(query, doc,
        # truncation=True, max_length=k) does (vLLM's way): [CLS] and the [SEP]s stay.
        r = httpx.post(server.url + "/v1/rerank", json={
            "model": "enc", "query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 9},
            timeout=60)
        assert r.status_code == 200, r.text
        truncated = [_truncated_reference_score(hf, folder, QUERY, d, 9) for d in DOCS]
        for x in r.json()["results"]:
            assert x["relevance_score"] == pytest.approx(truncated[x["index"]], abs=1e-6)
        assert truncated != pytest.approx(expected, abs=1e-3)  # the cut changed the scores
        # One text (/v1/classify): [CLS] + its first k - 2 tokens + [SEP], as transformers cuts.
        r = httpx.post(server.url + "/v1/classify", json={
            "model": "enc", "input": TEXTS[2], "truncate_prompt_tokens": 5}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["probs"][0] == pytest.approx(
            _truncated_reference_score(hf, folder, TEXTS[2], None, 5), abs=1e-6)
        for k in (1, 2):  # nothing of the text would be left (see the test above)
            r = httpx.post(server.url + "/v1/classify", json={
                "model": "enc", "input": TEXTS[2], "truncate_prompt_tokens": k}, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        r = httpx.post(server.url + "/v1/embeddings", json={"model": "enc", "input": "hi"},
                       timeout=60)
        assert r.status_code == 400, r.text
        # Token types follow the pair, not the [SEP] ids: these two pairs have the same ids
        # (a text holds the literal separator) and different types, so different scores.
        sep = "[SEP]" if arch == "bert" else "</s>"
        firsts, seconds = [f"hello {sep} world", "hello"], ["city", f"world {sep} city"]
        r = httpx.post(server.url + "/v1/score", json={"text_1": firsts, "text_2": seconds},
                       timeout=60)
        assert r.status_code == 200, r.text
        want = [_reference_score(hf, folder, a, b) for a, b in zip(firsts, seconds, strict=True)]
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-6)
        if arch == "bert":  # BERT's pair template makes the two pairs' ids the same
            assert encode(folder, firsts[0], seconds[0])[0] == \
                encode(folder, firsts[1], seconds[1])[0]
            assert abs(want[0] - want[1]) > 1e-4
        # A k the special tokens alone overflow: 400 naming the field.
        r = httpx.post(server.url + "/v1/rerank", json={
            "model": "enc", "query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 2},
            timeout=60)
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text
    finally:
        server.stop()


@torch.no_grad()
def _truncated_reference_score(hf, folder: Path, text: str, pair: str | None,  # noqa: ANN001
                               k: int) -> float:
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(str(folder))(text, pair, truncation=True, max_length=k,
                                                     return_tensors="pt")
    assert enc["input_ids"].shape[1] <= k
    return torch.sigmoid(hf(**enc).logits[0, 0]).item()
