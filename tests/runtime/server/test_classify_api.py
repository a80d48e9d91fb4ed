"""Sequence-classification checkpoints behind a real `argosy serve` (float32): POST /v1/classify
(vLLM's schema) on a 3-label classifier, and /v1/score + /v1/rerank as cross-encoder scores on
a one-label head. The reference is transformers' own `*ForSequenceClassification` and
tokenizer in this process: a class's probs are the softmax of its logits, a pair's score the
sigmoid of the logit of `tokenizer(text_1, text_2)` (the pair as vLLM joins it)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from serve_harness import ServerProcess, wait_for_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

TEXTS = ["The capital of France is Paris.", "I did not enjoy this film at all.", "Hi",
         "Horses and cows are both animals"]
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
        "Horses and cows are both animals", "Paris is in France."]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


class Reference:
    """transformers' classifier and tokenizer for a model folder (float32)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.folder = folder
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(folder), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))

    @torch.no_grad()
    def logits(self, text: str | list[int], text_pair: str | None = None) -> torch.Tensor:
        ids = text if isinstance(text, list) else self.tokenizer(text, text_pair)["input_ids"]
        return self.model(torch.tensor([ids])).logits[0].float()

    def probs(self, text: str | list[int]) -> list[float]:
        return self.logits(text).softmax(dim=0).tolist()

    def score(self, text_1: str, text_2: str) -> float:
        return self.logits(text_1, text_2).sigmoid().item()


def _serve(folder: Path, name: str) -> ServerProcess:
    return ServerProcess("--model", str(folder), "--served-model-name", name).wait_ready()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "qwen2",
                                   num_hidden_layers=2, num_labels=3, id2label=LABELS)
    proc = _serve(folder, "classifier")
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            yield http, Reference(folder)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "llama",
                                   num_hidden_layers=2, num_labels=1)
    proc = _serve(folder, "reranker")
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            yield http, Reference(folder)
    finally:
        proc.stop()


def post(http: httpx.Client, path: str, body: dict) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_error(http: httpx.Client, path: str, body: dict, param: str, match: str,
                 status: int = 400) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert match in error["message"], error


def test_classify_answers_vllms_schema_with_transformers_probs(classifier) -> None:  # noqa: ANN001
    http, ref = classifier
    reply = post(http, "/v1/classify", {"model": "classifier", "input": TEXTS})
    assert reply["id"].startswith("classify-") and reply["object"] == "list"
    assert reply["model"] == "classifier" and isinstance(reply["created"], int)
    assert [d["index"] for d in reply["data"]] == [0, 1, 2, 3]
    labels = ["negative", "neutral", "positive"]
    for d, text in zip(reply["data"], TEXTS, strict=True):
        assert set(d) == {"index", "label", "probs", "num_classes"}
        want = ref.probs(text)
        assert d["probs"] == pytest.approx(want, abs=1e-4)
        assert d["num_classes"] == 3
        assert d["label"] == labels[max(range(3), key=want.__getitem__)]
    tokens = sum(len(ref.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                              "completion_tokens": 0, "prompt_tokens_details": None}
    # One string, token ids, and vLLM's unversioned path; no model named: the served one.
    one = post(http, "/classify", {"input": TEXTS[0]})
    assert one["data"][0]["probs"] == pytest.approx(ref.probs(TEXTS[0]), abs=1e-4)
    ids = [[1, 504, 3458], [77]]
    by_ids = post(http, "/v1/classify", {"input": ids})
    for d, p in zip(by_ids["data"], ids, strict=True):
        assert d["probs"] == pytest.approx(ref.probs(p), abs=1e-4)
    cut = post(http, "/v1/classify", {"input": TEXTS[0], "truncate_prompt_tokens": 3})
    last3 = ref.tokenizer(TEXTS[0])["input_ids"][-3:]
    assert cut["data"][0]["probs"] == pytest.approx(ref.probs(last3), abs=1e-4)
    assert cut["usage"]["prompt_tokens"] == 3


def test_a_classify_batch_answers_what_the_live_endpoint_answers(classifier) -> None:  # noqa: ANN001
    """The Batch API runs /v1/classify lines (as vLLM's run_batch does)."""
    from openai import OpenAI

    http, _ = classifier
    client = OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/classify",
              "body": {"model": "classifier", "input": text}} for i, text in enumerate(TEXTS)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/classify",
                  "body": {"model": "classifier", "input": ""}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    input_id = client.files.create(file=("c.jsonl", data), purpose="batch").id
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/classify",
                                  completion_window="24h")
    batch = wait_for_batch(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(TEXTS), 1)
    records = {r["custom_id"]: r["response"]["body"] for r in map(
        json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i, text in enumerate(TEXTS):
        live = post(http, "/v1/classify", {"model": "classifier", "input": text})
        [got], [want] = records[f"c{i}"]["data"], live["data"]
        # float32 sums in another batch shape: equal to rounding, the same label.
        assert got["probs"] == pytest.approx(want["probs"], abs=1e-5)
        assert (got["label"], got["index"]) == (want["label"], want["index"])
    assert '"bad"' in client.files.content(batch.error_file_id).text


def test_concurrent_classify_requests_share_the_engine(classifier) -> None:  # noqa: ANN001
    http, ref = classifier
    replies: dict[int, dict] = {}

    def classify(i: int) -> None:
        replies[i] = post(http, "/v1/classify", {"input": [TEXTS[i % 4], TEXTS[(i + 1) % 4]]})

    threads = [threading.Thread(target=classify, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, reply in replies.items():
        assert reply["data"][0]["probs"] == pytest.approx(ref.probs(TEXTS[i % 4]), abs=1e-4)
        assert reply["data"][1]["probs"] == pytest.approx(ref.probs(TEXTS[(i + 1) % 4]), abs=1e-4)
    assert len(replies) == 6


def test_what_a_classifier_refuses(classifier) -> None:  # noqa: ANN001
    http, _ = classifier
    assert_error(http, "/v1/embeddings", {"input": "Hi"}, "model", "sequence-classification")
    assert_error(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "model",
                 "not generation")
    assert_error(http, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}]}, "model", "not generation")
    # Three labels are no relevance score: vLLM scores with one-label heads only.
    assert_error(http, "/v1/score", {"text_1": "a", "text_2": "b"}, "model", "3 labels")
    assert_error(http, "/v1/rerank", {"query": "a", "documents": ["b"]}, "model", "3 labels")
    assert_error(http, "/v1/classify", {"input": []}, "input", "must not be empty")
    assert_error(http, "/v1/classify", {"input": "Hi", "temperature": 0}, "temperature",
                 "unknown field")
    assert_error(http, "/v1/classify", {"input": [[49152]]}, "input", "outside the vocabulary")
    assert_error(http, "/v1/classify", {"input": "Hi", "truncate_prompt_tokens": 4096},
                 "truncate_prompt_tokens", "larger than")
    assert_error(http, "/v1/classify", {"model": "other", "input": "Hi"}, "model",
                 "does not exist", status=404)
    assert http.get("/health").status_code == 200


def test_cross_encoder_scores_are_sigmoids_of_the_pair_logit(reranker) -> None:  # noqa: ANN001
    http, ref = reranker
    one = post(http, "/v1/score", {"model": "reranker", "text_1": QUERY, "text_2": DOCS[1]})
    assert one["id"].startswith("score-") and one["object"] == "list"
    assert one["data"] == [{"index": 0, "object": "score",
                            "score": pytest.approx(ref.score(QUERY, DOCS[1]), abs=1e-4)}]
    pair_tokens = len(ref.tokenizer(QUERY, DOCS[1])["input_ids"])
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] == pair_tokens

    many = post(http, "/score", {"text_1": [QUERY], "text_2": DOCS})  # 1-to-N
    want = [ref.score(QUERY, d) for d in DOCS]
    assert [d["score"] for d in many["data"]] == pytest.approx(want, abs=1e-4)
    assert max(want) - min(want) > 1e-3  # the documents really score differently
    pairs = post(http, "/v1/score", {"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[2], QUERY]})
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [ref.score(QUERY, DOCS[2]), ref.score(DOCS[0], QUERY)], abs=1e-4)
    # Order matters to a cross-encoder (one joined prompt, not two embeddings).
    assert ref.score(DOCS[0], QUERY) != pytest.approx(ref.score(QUERY, DOCS[0]), abs=1e-4)


def test_offline_llm_score_is_the_same_cross_encoder_score(reranker) -> None:  # noqa: ANN001
    from argosy_runtime import LLM

    _, ref = reranker
    llm = LLM(model=str(ref.folder), dtype="float32")
    assert llm.score(QUERY, DOCS) == pytest.approx([ref.score(QUERY, d) for d in DOCS],
                                                   abs=1e-4)
    assert llm.score([QUERY, DOCS[0]], [DOCS[2], QUERY]) == pytest.approx(
        [ref.score(QUERY, DOCS[2]), ref.score(DOCS[0], QUERY)], abs=1e-4)
    with pytest.raises(ValueError, match="text_2: 3 texts do not pair with 2 text_1"):
        llm.score([QUERY, DOCS[0]], DOCS[:3])


def test_offline_llm_score_refuses_a_multi_label_classifier(classifier) -> None:  # noqa: ANN001
    from argosy_runtime import LLM

    _, ref = classifier
    with pytest.raises(ValueError, match="model: a classifier with 3 labels is no scorer"):
        LLM(model=str(ref.folder), dtype="float32").score(QUERY, DOCS)


def test_cross_encoder_rerank(reranker) -> None:  # noqa: ANN001
    http, ref = reranker
    want = [ref.score(QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = post(http, path, {"model": "reranker", "query": QUERY, "documents": DOCS})
        assert [r["index"] for r in reply["results"]] == order
        for r in reply["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
            assert r["document"] == {"text": DOCS[r["index"]]}
    top = post(http, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                    "return_documents": False})
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])
    tokens = sum(len(ref.tokenizer(QUERY, d)["input_ids"]) for d in DOCS)
    assert top["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # truncate_prompt_tokens cuts each pair as vLLM does, with transformers'
    # tokenizer(query, doc, truncation=True, max_length=k): the longer text loses its end.
    cut = post(http, "/v1/rerank", {"query": QUERY, "documents": DOCS[:1],
                                    "truncate_prompt_tokens": 5})
    first5 = ref.tokenizer(QUERY, DOCS[0], truncation=True, max_length=5)["input_ids"]
    assert len(first5) == 5
    assert cut["results"][0]["relevance_score"] == pytest.approx(
        ref.logits(first5).sigmoid().item(), abs=1e-4)


def test_cross_encoder_classify_and_errors(reranker) -> None:  # noqa: ANN001
    http, ref = reranker
    reply = post(http, "/v1/classify", {"input": TEXTS[:2]})
    for d, text in zip(reply["data"], TEXTS[:2], strict=True):
        assert d["label"] == "LABEL_0" and d["num_classes"] == 1
        assert d["probs"] == pytest.approx([ref.logits(text).sigmoid().item()], abs=1e-4)
    assert_error(http, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2",
                 "send one text_1")
    assert_error(http, "/v1/score", {"text_1": [], "text_2": DOCS}, "text_1", "must not be empty")
    assert_error(http, "/v1/rerank", {"query": QUERY, "documents": []}, "documents",
                 "must not be empty")
    assert_error(http, "/v1/embeddings", {"input": "Hi"}, "model", "sequence-classification")


def test_a_too_long_pair_names_the_text_that_is_too_long(reranker) -> None:  # noqa: ANN001
    """A pair over the model's length is a 400 naming the field whose text is the long one
    (the one to shorten), the query's as well as the document's."""
    http, _ = reranker
    long = QUERY * 300  # ~2,100 tokens: more than the model's 2,048 alone
    for path, body, param in (
            ("/v1/rerank", {"query": long, "documents": ["x"]}, "query"),
            ("/v1/rerank", {"query": "x", "documents": ["y", long]}, "documents"),
            ("/v1/score", {"text_1": long, "text_2": "x"}, "text_1"),
            ("/v1/score", {"text_1": "x", "text_2": ["y", long]}, "text_2")):
        assert_error(http, path, body, param, "maximum context length")


def test_a_pair_too_long_whatever_its_tokenization_is_refused_untokenized(reranker) -> None:  # noqa: ANN001
    """A pair with more characters than the model's length can hold in tokens is a 400 at
    once, as such an /v1/embeddings input is: not after tokenizing the long text again
    with each of up to 2048 documents (minutes of tokenizer time for one request)."""
    http, _ = reranker
    long = "word " * 40_000  # 200k characters: over 2048 tokens of at most 81 characters
    docs = [f"document {i}" for i in range(512)]
    for path, body, param in (
            ("/v1/rerank", {"query": long, "documents": docs}, "query"),
            ("/v1/score", {"text_1": "x", "text_2": [*docs, long]}, "text_2")):
        start = time.monotonic()
        resp = http.post(path, json=body)
        elapsed = time.monotonic() - start
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert "characters" in error["message"], error
        assert elapsed < 5, elapsed  # 512 tokenizations of 200k characters took ~10 s


def test_classify_on_a_model_without_a_classification_head(http: httpx.Client) -> None:
    """The shared server (SmolLM2, a causal LM) keeps cosine scores and refuses /v1/classify."""
    assert_error(http, "/v1/classify", {"input": "Hi"}, "model", "no classification head")
    assert_error(http, "/classify", {"input": ["Hi", "there"]}, "model", "no classification head")
