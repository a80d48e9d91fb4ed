"""An LLM reranker behind a real `argosy serve` (float32), started the way vLLM serves
Qwen3-Reranker: a Qwen3ForCausalLM checkpoint with `--hf-overrides '{"architectures":
["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}'` and `--chat-template` (the score template shipped in
docs/score_templates/). /v1/score, /score, /v1/rerank and /rerank answer P(yes): the softmax
over the no/yes logits of the last token transformers' Qwen3ForCausalLM gives for the prompt
the model card builds."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from lm_reranker_reference import (  # noqa: E402
    DOCS,
    QUERY,
    QWEN3_RERANKER,
    TEMPLATE,
    Reference,
    qwen3_reranker_prompt,
)
from model_factory import QWEN3_TEST_SHAPE, make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts an `argosy serve` process


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "qwen3",
                                   tie_word_embeddings=True, **QWEN3_TEST_SHAPE)
    proc = ServerProcess("--model", str(folder), "--served-model-name", "reranker",
                         "--hf-overrides", json.dumps(QWEN3_RERANKER),
                         "--chat-template", str(TEMPLATE)).wait_ready()
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            yield http, Reference(folder)
    finally:
        proc.stop()


def post(http: httpx.Client, path: str, body: dict) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt_ids(ref: Reference, query: str, document: str) -> list[int]:
    return ref.tokenizer(qwen3_reranker_prompt(query, document))["input_ids"]


def test_score_is_p_yes_of_the_templated_prompt(served) -> None:  # noqa: ANN001
    http, ref = served
    want = [ref.p_yes(qwen3_reranker_prompt(QUERY, d)) for d in DOCS]
    assert max(want) - min(want) > 1e-3
    for path in ("/v1/score", "/score"):
        reply = post(http, path, {"model": "reranker", "text_1": QUERY, "text_2": DOCS})
        assert reply["model"] == "reranker" and reply["object"] == "list"
        assert [d["index"] for d in reply["data"]] == [0, 1, 2]
        assert [d["score"] for d in reply["data"]] == pytest.approx(want, abs=2e-5)
        tokens = sum(len(prompt_ids(ref, QUERY, d)) for d in DOCS)
        assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                                  "completion_tokens": 0}
    pairs = post(http, "/v1/score", {"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], QUERY]})
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [want[1], ref.p_yes(qwen3_reranker_prompt(DOCS[0], QUERY))], abs=2e-5)


def test_rerank_orders_by_p_yes(served) -> None:  # noqa: ANN001
    http, ref = served
    want = [ref.p_yes(qwen3_reranker_prompt(QUERY, d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank"):
        reply = post(http, path, {"model": "reranker", "query": QUERY, "documents": DOCS,
                                  "top_n": 2})
        assert [r["index"] for r in reply["results"]] == order[:2]
        for r in reply["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=2e-5)
            assert r["document"] == {"text": DOCS[r["index"]]}
    # truncate_prompt_tokens cuts the rendered prompt as vLLM does, with transformers'
    # tokenizer(prompt, truncation=True, max_length=k): its first k tokens stay.
    cut = post(http, "/v1/rerank", {"query": QUERY, "documents": DOCS[:1],
                                    "truncate_prompt_tokens": 12})
    head = ref.tokenizer(qwen3_reranker_prompt(QUERY, DOCS[0]), truncation=True,
                         max_length=12)["input_ids"]
    assert head == prompt_ids(ref, QUERY, DOCS[0])[:12]
    with torch.no_grad():
        logits = ref.model(torch.tensor([head])).logits[0, -1]
    no, yes = ref.token("no"), ref.token("yes")
    assert cut["results"][0]["relevance_score"] == pytest.approx(
        logits[[no, yes]].softmax(0)[1].item(), abs=2e-5)


def test_what_the_reranker_refuses(served) -> None:  # noqa: ANN001
    http, _ = served
    for path, body, param in [
            ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
            ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
            ("/v1/rerank", {"query": QUERY * 300, "documents": ["x"]}, "query"),  # the long one
            ("/v1/rerank", {"query": QUERY, "documents": ["x", QUERY * 300]}, "documents"),
            ("/v1/embeddings", {"input": "Hi"}, "model"),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "model")]:
        resp = http.post(path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
    # /v1/classify answers the head's sigmoid: the same P(yes) for a prompt sent whole.
    reply = post(http, "/v1/classify", {"input": qwen3_reranker_prompt(QUERY, DOCS[1])})
    assert reply["data"][0]["num_classes"] == 1
    score = post(http, "/v1/score", {"text_1": QUERY, "text_2": DOCS[1]})["data"][0]["score"]
    assert reply["data"][0]["probs"][0] == pytest.approx(score, abs=1e-6)


def test_a_bad_chat_template_flag_exits_2(capsys: pytest.CaptureFixture) -> None:
    from argosy_runtime.cli.main import main

    assert main(["serve", "--chat-template", "no/such/template.jinja"]) == 2
    assert "looks like a file path" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "{% if %}"]) == 2
    assert "not a valid jinja template" in capsys.readouterr().err


def test_a_reranker_without_a_template_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from argosy_runtime.server.app import _apply_chat_template
    from argosy_runtime.server.config import ServerConfig

    spec = SimpleNamespace(classifier_method="from_2_way_softmax",
                           classifier_from_token=("no", "yes"))
    engine = SimpleNamespace(spec=spec, served_model_name="rr",
                             tokenizer=SimpleNamespace(chat_template="own"))
    with caplog.at_level(logging.WARNING, logger="argosy.server"):
        _apply_chat_template(engine, ServerConfig())
    assert "rr is an LLM reranker" in caplog.text and "--chat-template" in caplog.text
    assert engine.tokenizer.chat_template == "own"
    caplog.clear()
    _apply_chat_template(engine, ServerConfig(chat_template="{{ 1 }}"))
    assert engine.tokenizer.chat_template == "{{ 1 }}" and not caplog.text
