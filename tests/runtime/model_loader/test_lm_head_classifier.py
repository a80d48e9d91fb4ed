"""A causal LM served as a reranker through its lm_head's "yes"/"no" rows, vLLM's conversion
(`--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'`, Qwen3-Reranker):
`LLM.score` equals P(yes) = softmax over the no/yes logits of the last token that
transformers' own Qwen3ForCausalLM gives for the same prompt, tied lm_head or not, with and
without a score template; and each misuse is a ValueError that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from argosy_runtime import LLM
from argosy_runtime.model_loader import ModelSpec, load_checkpoint
from argosy_runtime.model_loader.lm_head_classifier import convert_spec
from lm_reranker_reference import (
    DOCS,
    QUERY,
    QWEN3_RERANKER,
    TEMPLATE,
    Reference,
    qwen3_reranker_prompt,
)
from model_factory import QWEN3_TEST_SHAPE, make_random_model_dir


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reranker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(LLM with Qwen3-Reranker's overrides, transformers reference) on a tiny random Qwen3;
    tied: lm_head is the embedding (Qwen3-Reranker-0.6B), so the file stores no lm_head."""
    folder = make_random_model_dir(tmp_path_factory.mktemp("rr"), "qwen3",
                                   tie_word_embeddings=request.param, **QWEN3_TEST_SHAPE)
    return LLM(model=str(folder), dtype="float32", hf_overrides=QWEN3_RERANKER), Reference(folder)


def test_scores_are_p_yes_of_the_causal_lm(reranker) -> None:  # noqa: ANN001
    llm, ref = reranker
    spec = llm.engine.spec
    assert spec.num_labels == 1 and not spec.has_lm_head and not spec.use_sep_token
    assert spec.classifier_method == "from_2_way_softmax"
    assert spec.classifier_token_ids == (ref.token("no"), ref.token("yes"))
    # No score template: vLLM's LLM-reranker default, the two texts as one string.
    want = [ref.p_yes(QUERY + d) for d in DOCS]
    assert llm.score(QUERY, DOCS) == pytest.approx(want, abs=2e-5)
    assert max(want) - min(want) > 1e-3  # the documents really score differently
    # The score template: the prompt the model card builds, P(yes) of its last token.
    want = [ref.p_yes(qwen3_reranker_prompt(QUERY, d)) for d in DOCS]
    for template in (str(TEMPLATE), TEMPLATE.read_text()):  # a file, or the template itself
        assert llm.score(QUERY, DOCS, chat_template=template) == pytest.approx(want, abs=2e-5)
    # N-to-N pairs and classify: the head's one logit is logit(yes) - logit(no).
    assert llm.score([QUERY, DOCS[0]], [DOCS[1], QUERY], chat_template=str(TEMPLATE)) == (
        pytest.approx([want[1], ref.p_yes(qwen3_reranker_prompt(DOCS[0], QUERY))], abs=2e-5))
    [out] = llm.classify(qwen3_reranker_prompt(QUERY, DOCS[1]))
    logits = ref.last_logits(qwen3_reranker_prompt(QUERY, DOCS[1]))
    assert out.classification.logits == pytest.approx(
        [(logits[ref.token("yes")] - logits[ref.token("no")]).item()], abs=1e-4)


def p_yes_of_ids(ref: Reference, ids: list[int], no: str = "no", yes: str = "yes") -> float:
    with torch.no_grad():
        logits = ref.model(torch.tensor([ids])).logits[0, -1]
    return logits[[ref.token(no), ref.token(yes)]].softmax(0)[1].item()


def test_truncate_prompt_tokens_cuts_the_end(reranker) -> None:  # noqa: ANN001
    """vLLM's truncate_prompt_tokens on a reranker: each pair's prompt is cut by transformers'
    tokenizer(prompt, truncation=True, max_length=k), so its first k tokens stay: the query,
    then as much of the document as fits (with a score template, its end goes too)."""
    llm, ref = reranker
    k = 12
    cut = [ref.tokenizer(QUERY + d, truncation=True, max_length=k)["input_ids"] for d in DOCS]
    assert all(ids == ref.tokenizer(QUERY + d)["input_ids"][:k] for ids, d in zip(cut, DOCS))
    assert llm.score(QUERY, DOCS, truncate_prompt_tokens=k) == pytest.approx(
        [p_yes_of_ids(ref, ids) for ids in cut], abs=2e-5)
    full = ref.tokenizer(qwen3_reranker_prompt(QUERY, DOCS[1]))["input_ids"]
    k = len(full) - 2
    head = ref.tokenizer(qwen3_reranker_prompt(QUERY, DOCS[1]), truncation=True,
                         max_length=k)["input_ids"]
    assert head == full[:k]
    assert llm.score(QUERY, DOCS[1], chat_template=str(TEMPLATE), truncate_prompt_tokens=k) \
        == pytest.approx([p_yes_of_ids(ref, head)], abs=2e-5)
    # -1: the model's length (nothing to cut here); beyond it, an error.
    assert llm.score(QUERY, DOCS, truncate_prompt_tokens=-1) == llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or in"):
        llm.score(QUERY, DOCS, truncate_prompt_tokens=llm.engine.max_model_len + 1)


def test_score_template_errors(reranker) -> None:  # noqa: ANN001
    llm, _ = reranker
    with pytest.raises(ValueError, match="looks like a file path"):
        llm.score(QUERY, DOCS, chat_template="no/such/template.jinja")
    with pytest.raises(ValueError, match="not a valid jinja template"):
        llm.score(QUERY, DOCS, chat_template="{% if %}")
    raising = ("{% if messages[1].content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
               "{{ messages[0].content }}")
    with pytest.raises(ValueError, match="cannot apply the score template.*no boom"):
        llm.score(QUERY, ["fine", "boom"], chat_template=raising)


def test_one_token_and_two_way_methods(tmp_path: Path) -> None:
    """`method` spelled out: no_post_processing with one token (bge-reranker-v2-gemma's form,
    score = sigmoid of that token's logit) and from_2_way_softmax on a Qwen2 (mxbai-rerank-v2's
    form, here with the tokens "0" / "1")."""
    folder = make_random_model_dir(tmp_path, "qwen2")
    ref = Reference(folder)
    one = LLM(model=str(folder), dtype="float32", hf_overrides={
        "architectures": ["Qwen2ForSequenceClassification"], "classifier_from_token": ["yes"],
        "method": "no_post_processing"})
    want = [ref.last_logits(QUERY + d)[ref.token("yes")].sigmoid().item() for d in DOCS]
    assert one.score(QUERY, DOCS) == pytest.approx(want, abs=2e-5)
    del one
    two = LLM(model=str(folder), dtype="float32", hf_overrides={
        "architectures": ["Qwen2ForSequenceClassification"], "classifier_from_token": ["0", "1"],
        "method": "from_2_way_softmax"})
    want = [ref.p_yes(QUERY + d, no="0", yes="1") for d in DOCS]
    assert two.score(QUERY, DOCS) == pytest.approx(want, abs=2e-5)
    # use_sep_token: true brings back the tokenizer's pair template (the two encodings).
    sep = LLM(model=str(folder), dtype="float32", hf_overrides={
        "architectures": ["Qwen2ForSequenceClassification"], "classifier_from_token": ["0", "1"],
        "method": "from_2_way_softmax", "use_sep_token": True})
    pair = ref.tokenizer(QUERY, DOCS[2])["input_ids"]
    with torch.no_grad():
        logits = ref.model(torch.tensor([pair])).logits[0, -1]
    assert sep.score(QUERY, DOCS[2]) == pytest.approx(
        [logits[[ref.token("0"), ref.token("1")]].softmax(0)[1].item()], abs=2e-5)
    # Truncated as tokenizer(query, doc, truncation=True, max_length=k): the longer text
    # loses its end first.
    cut = ref.tokenizer(QUERY, DOCS[2], truncation=True, max_length=9)["input_ids"]
    assert len(cut) == 9
    assert sep.score(QUERY, DOCS[2], truncate_prompt_tokens=9) == pytest.approx(
        [p_yes_of_ids(ref, cut, no="0", yes="1")], abs=2e-5)


def test_the_head_stays_float32_in_bfloat16(tmp_path: Path) -> None:
    folder = make_random_model_dir(tmp_path, "qwen3", dtype=torch.bfloat16, **QWEN3_TEST_SHAPE)
    llm = LLM(model=str(folder), dtype="bfloat16", hf_overrides=QWEN3_RERANKER)
    head = llm.engine.model.score
    ckpt = load_checkpoint(folder, QWEN3_RERANKER)
    rows = load_checkpoint(folder).state_dict()["lm_head.weight"]
    no, yes = ckpt.spec.classifier_token_ids
    assert head.weight.dtype == torch.float32
    assert torch.equal(head.weight[0].cpu(), rows[yes].float() - rows[no].float())
    assert 0.0 <= llm.score(QUERY, DOCS[0])[0] <= 1.0


def _spec(tmp_path: Path, overrides: dict, **kwargs) -> ModelSpec:  # noqa: ANN003
    folder = make_random_model_dir(tmp_path, "qwen3", **QWEN3_TEST_SHAPE, **kwargs)
    return load_checkpoint(folder, overrides).spec


@pytest.mark.parametrize("overrides, match", [
    ({"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True},
     "is_original_qwen3_reranker applies to architectures"),
    ({"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
      "is_original_qwen3_reranker": True}, "is_original_qwen3_reranker applies to"),
    ({**QWEN3_RERANKER, "classifier_from_token": ["yes"]}, "two tokens"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]},
     "classifier_from_token needs method"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
      "method": "softmax"}, "method must be one of from_2_way_softmax, no_post_processing"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b", "c"],
      "method": "from_2_way_softmax"}, "needs two classifier_from_token entries"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [],
      "method": "no_post_processing"}, "non-empty list of token strings"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "method": "no_post_processing"},
     "needs classifier_from_token"),
    ({"classifier_from_token": ["yes"], "method": "no_post_processing"},
     "set architectures to a sequence-classification class"),
    ({**QWEN3_RERANKER, "use_sep_token": "no"}, "use_sep_token must be true or false"),
])
def test_misuse_is_a_value_error_saying_what_to_change(tmp_path: Path, overrides: dict,
                                                       match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _spec(tmp_path, overrides)


def test_tokens_must_be_vocabulary_entries(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"' yes' is not a token of the model's vocabulary.*"
                                         r"encodes to the token 'Ġyes'"):
        _spec(tmp_path, {**QWEN3_RERANKER, "classifier_from_token": ["no", " yes"]})
    with pytest.raises(ValueError, match=r"'yes please' is not a token.*encodes to 2 tokens"):
        _spec(tmp_path, {**QWEN3_RERANKER, "classifier_from_token": ["no", "yes please"]})
    # The tokenizer knows more ids than the lm_head has rows.
    with pytest.raises(ValueError, match="beyond the lm_head's 4000 rows"):
        _spec(tmp_path, {**QWEN3_RERANKER, "vocab_size": 4000})


def test_a_checkpoint_without_a_usable_lm_head(tmp_path: Path) -> None:
    headless = make_random_model_dir(tmp_path, "qwen3", headless=True, **QWEN3_TEST_SHAPE)
    with pytest.raises(ValueError, match="headless Qwen3Model"):
        load_checkpoint(headless, QWEN3_RERANKER)
    classifier = make_random_model_dir(tmp_path, "qwen3", num_labels=1, **QWEN3_TEST_SHAPE)
    with pytest.raises(ValueError, match="already a Qwen3ForSequenceClassification"):
        load_checkpoint(classifier, QWEN3_RERANKER)
    # A tied checkpoint stores no lm_head; saying it is untied leaves nothing to read.
    tied = make_random_model_dir(tmp_path, "qwen3", name="tied", tie_word_embeddings=True,
                                 **QWEN3_TEST_SHAPE)
    ckpt = load_checkpoint(tied, {**QWEN3_RERANKER, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="missing 1 weights.*lm_head.weight.*tie_word_embeddings"):
        ckpt.state_dict()


def test_plain_configs_are_untouched(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {})
    assert spec.classifier_method is None and spec.use_sep_token and spec.has_lm_head
    # A native cross-encoder may say use_sep_token: false (vLLM's config field).
    assert not convert_spec(spec, {"use_sep_token": False}).use_sep_token
