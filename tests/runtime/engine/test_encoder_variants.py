"""Encoder checkpoints in the config variants real models ship (models/bert.py,
model_loader/encoder_config.py), against transformers in float32: other activations and
LayerNorm eps, a many-label head with id2label, sentence-transformers folders whose
sentence_bert_config.json cuts the context (max_seq_length) or whose modules.json holds a
module not served (Dense: refused, never ignored), Matryoshka configs, and relative position
embeddings (refused).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from argosy_runtime import LLM, PoolingParams
from engine_helpers import assert_no_leaks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from encoder_factory import encode, load_hf, make_encoder_dir  # noqa: E402

TEXTS = ["the cat sat on the mat", "hello", "what is the capital of france? paris"]
TOL = dict(atol=1e-5, rtol=1e-5)


def _edit_json(path: Path, **fields: object) -> None:
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **fields}))


@torch.no_grad()
def _hf_hidden(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    base = getattr(hf, "bert", None) or getattr(hf, "roberta", None) or hf
    return base(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("arch,act,eps", [("bert", "gelu_new", 1e-5),
                                          ("xlm_roberta", "relu", 1e-7),
                                          ("bert", "gelu_pytorch_tanh", 1e-3)])
def test_activations_and_layer_norm_eps(tmp_path: Path, arch: str, act: str, eps: float) -> None:
    folder = make_encoder_dir(tmp_path, arch, pooling="mean", normalize=False)
    _edit_json(folder / "config.json", hidden_act=act, layer_norm_eps=eps)
    hf = load_hf(folder)
    assert (hf.config.hidden_act, hf.config.layer_norm_eps) == (act, eps)
    for text, out in zip(TEXTS, LLM(model=str(folder), dtype="float32").embed(TEXTS),
                         strict=True):
        want = _hf_hidden(hf, encode(folder, text)[0]).mean(dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["bert", "xlm_roberta"])
def test_many_label_head_with_id2label(tmp_path: Path, arch: str) -> None:
    folder = make_encoder_dir(tmp_path, arch, classifier=True, num_labels=3)
    labels = {"0": "neg", "1": "neutral", "2": "pos"}
    _edit_json(folder / "config.json", id2label=labels, label2id={v: int(k) for k, v in
                                                                   labels.items()})
    hf = load_hf(folder)
    llm = LLM(model=str(folder), dtype="float32")
    for text, out in zip(TEXTS, llm.classify(TEXTS), strict=True):
        logits = hf(torch.tensor([encode(folder, text)[0]])).logits[0]
        torch.testing.assert_close(torch.tensor(out.classification.logits), logits, **TOL)
        assert out.classification.label == hf.config.id2label[int(logits.argmax())]
    with pytest.raises(ValueError, match="no scorer"):
        llm.score("hello", "world")


@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_relative_position_embeddings_are_refused(tmp_path: Path, kind: str) -> None:
    folder = make_encoder_dir(tmp_path, "bert")
    _edit_json(folder / "config.json", position_embedding_type=kind)
    with pytest.raises(ValueError, match=f"position_embedding_type '{kind}' is not supported"):
        LLM(model=str(folder), dtype="float32")


@torch.no_grad()
@pytest.mark.parametrize("arch", ["bert", "xlm_roberta"])
def test_sentence_bert_max_seq_length_is_the_context(tmp_path: Path, arch: str) -> None:
    """sentence-transformers cuts every input to sentence_bert_config.json's max_seq_length
    (all-MiniLM-L6-v2: 256 of 512 positions). The context is that length (vLLM's rule): a
    longer input is refused rather than embedded past where the model was used, and one that
    fits equals transformers'."""
    folder = make_encoder_dir(tmp_path, arch, pooling="mean")
    _edit_json(folder / "sentence_bert_config.json", max_seq_length=12, do_lower_case=False)
    llm = LLM(model=str(folder), dtype="float32")
    assert llm.engine.max_model_len == 12
    fits, longer = "hello world the cat sat on the mat", "the cat sat on the mat " * 3
    assert len(encode(folder, fits)[0]) <= 12 < len(encode(folder, longer)[0])
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.embed(longer)
    [out] = llm.embed(fits)
    want = F.normalize(_hf_hidden(load_hf(folder), encode(folder, fits)[0]).mean(dim=0), dim=0)
    torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)
    assert_no_leaks(llm.engine)


def test_unserved_sentence_transformers_modules_are_refused(tmp_path: Path) -> None:
    """LaBSE-like: Pooling, then a Dense projection (tanh), then Normalize. Ignoring the
    Dense layer would serve a different vector than sentence-transformers: refused."""
    folder = make_encoder_dir(tmp_path, "bert", pooling="cls")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"models\.Dense'\] are not supported"):
        LLM(model=str(folder), dtype="float32")


@torch.no_grad()
def test_matryoshka_encoder(tmp_path: Path) -> None:
    """is_matryoshka in config.json or through hf_overrides lets an encoder's embedding be
    cut (then normalized), as a decoder's; without it a shorter size is refused."""
    folder = make_encoder_dir(tmp_path, "bert")
    hf = load_hf(folder)
    want = F.normalize(_hf_hidden(hf, encode(folder, "hello")[0])[0, :8], dim=0)
    with pytest.raises(ValueError, match="not trained to shorten"):
        LLM(model=str(folder), dtype="float32").embed("hello", PoolingParams(dimensions=8))
    llm = LLM(model=str(folder), dtype="float32", hf_overrides={"is_matryoshka": True})
    [out] = llm.embed("hello", PoolingParams(dimensions=8))
    torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)
    _edit_json(folder / "config.json", matryoshka_dimensions=[8, 16])
    llm = LLM(model=str(folder), dtype="float32")
    [out] = llm.embed("hello", PoolingParams(dimensions=8))
    torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("hello", PoolingParams(dimensions=12))


def test_do_lower_case_over_a_cased_tokenizer_is_refused(tmp_path: Path) -> None:
    """sentence_bert_config.json's do_lower_case: sentence-transformers lowercases each text
    before tokenizing. Over BERT's uncased tokenizer that changes nothing (served); over a
    cased one (XLM-R's) "Hello" would embed differently: refused."""
    bert = make_encoder_dir(tmp_path, "bert", pooling="cls")
    _edit_json(bert / "sentence_bert_config.json", do_lower_case=True)
    upper, lower = LLM(model=str(bert), dtype="float32").embed(["Hello World", "hello world"])
    assert upper.embedding == lower.embedding
    xlmr = make_encoder_dir(tmp_path, "xlm_roberta", pooling="cls")
    assert encode(xlmr, "Hello")[0] != encode(xlmr, "hello")[0]
    _edit_json(xlmr / "sentence_bert_config.json", do_lower_case=True)
    with pytest.raises(ValueError, match="do_lower_case is true but the tokenizer keeps case"):
        LLM(model=str(xlmr), dtype="float32")


@torch.no_grad()
@pytest.mark.parametrize("config,activation", [
    # ms-marco-MiniLM-L-6-v2's config: scores are the raw logit (sentence-transformers, vLLM)
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, None),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}},
     torch.tanh),
    ({}, torch.sigmoid),
])
def test_cross_encoder_score_activation_from_the_config(tmp_path: Path, config: dict,
                                                        activation) -> None:  # noqa: ANN001
    folder = make_encoder_dir(tmp_path, "bert", classifier=True)
    _edit_json(folder / "config.json", **config)
    hf = load_hf(folder)
    llm = LLM(model=str(folder), dtype="float32")
    query, docs = "capital of france", ["paris is the capital", "the cat sat"]
    for doc, score in zip(docs, llm.score(query, docs), strict=True):
        ids, types = encode(folder, query, doc)
        logit = hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0]
        want = logit if activation is None else activation(logit)
        assert score == pytest.approx(want.item(), abs=1e-5)
    # /v1/classify keeps the head's probabilities (vLLM: the activation is the score's)
    (out,) = llm.classify([query])
    assert out.classification.probs[0] == pytest.approx(
        torch.sigmoid(torch.tensor(out.classification.logits[0])).item(), abs=1e-6)
    assert_no_leaks(llm.engine)


def test_an_unknown_cross_encoder_activation_is_refused(tmp_path: Path) -> None:
    folder = make_encoder_dir(tmp_path, "bert", classifier=True)
    _edit_json(folder / "config.json",
               sbert_ce_default_activation_function="torch.nn.modules.activation.Softmax")
    with pytest.raises(ValueError, match="activation.*Softmax.*not supported"):
        LLM(model=str(folder), dtype="float32")
