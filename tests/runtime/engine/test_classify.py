"""Classify requests (PoolingParams(task="classify"), `LLM.classify`) on sequence-classification
checkpoints equal transformers' own `*ForSequenceClassification` (float32, CPU).

The reference is transformers' pooled logits for the prompt alone (batch 1: the last token,
which is what it picks for an unpadded prompt), then softmax over the labels (sigmoid for a
one-label head; config.json `problem_type` as transformers' pipeline reads it). Covered: mixed-length batches on llama and qwen2 (q/k/v biases), one-label
heads, many classify requests sharing steps in small prefill chunks, preemption in the middle
of a prompt, prefix-cache hits, bfloat16, and the errors a caller gets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLM, LLMEngine, PoolingParams, SamplingParams
from argosy_runtime.outputs import ClassificationOutput, RequestOutput
from engine_helpers import assert_no_leaks
from model_factory import make_random_model_dir

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


class HFClassifier:
    """transformers' *ForSequenceClassification, one prompt at a time (float32)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(folder), dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def classifier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, HFClassifier]:
    folder = make_random_model_dir(tmp_path_factory.mktemp("cls"), request.param, num_labels=3,
                                   id2label=LABELS)
    return folder, HFClassifier(folder)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFClassifier]:
    """A one-label head: how reward models and cross-encoder rerankers are saved."""
    folder = make_random_model_dir(tmp_path_factory.mktemp("cls"), "qwen2", num_labels=1)
    return folder, HFClassifier(folder)


def random_prompts(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(1, longest))]
            for _ in range(count)]


def assert_matches(out: RequestOutput, hf: HFClassifier, labels: tuple[str, ...]) -> None:
    want = hf.logits(out.prompt_token_ids)
    got = out.classification
    assert isinstance(got, ClassificationOutput) and out.embedding is None
    assert out.finished and out.outputs == []
    torch.testing.assert_close(torch.tensor(got.logits), want, atol=1e-4, rtol=1e-4)
    probs = want.sigmoid() if len(labels) == 1 else want.softmax(dim=0)
    torch.testing.assert_close(torch.tensor(got.probs), probs, atol=1e-5, rtol=1e-4)
    assert got.num_classes == len(labels)
    assert got.label == labels[int(probs.argmax())]


def test_mixed_length_batch_matches_transformers(classifier) -> None:  # noqa: ANN001
    folder, hf = classifier
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    prompts = random_prompts(1, 6) + [[7]]
    outs = llm.classify(prompts)
    assert [o.prompt_token_ids for o in outs] == prompts  # prompt order
    for o in outs:
        assert_matches(o, hf, ("negative", "neutral", "positive"))
    assert len({o.classification.label for o in outs}) > 1  # not one answer for all
    # Text prompts are tokenized as for generation (BOS and all).
    [text] = llm.classify("The capital of France is Paris.")
    assert_matches(text, hf, ("negative", "neutral", "positive"))
    assert_no_leaks(llm.engine)


def test_one_label_head_is_a_sigmoid(cross_encoder) -> None:  # noqa: ANN001
    folder, hf = cross_encoder
    llm = LLM(model=str(folder), dtype="float32")
    for o in llm.classify(random_prompts(2, 4)):
        assert_matches(o, hf, ("LABEL_0",))
        assert 0 < o.classification.probs[0] < 1 and o.classification.label == "LABEL_0"


def test_many_classify_requests_share_small_chunks(classifier) -> None:  # noqa: ANN001
    """8-token steps: long prompts span several steps beside other requests' chunks, and
    several requests end in one step (their last rows go through the head together)."""
    folder, hf = classifier
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4,
                       max_num_batched_tokens=8)
    prompts = random_prompts(3, 8, longest=30) + [[11], [12, 13]]
    ending_together = 0
    execute = engine.runner.execute

    def recording_execute(sched):  # noqa: ANN001, ANN202
        nonlocal ending_together
        ending_together = max(ending_together, sum(sr.completes_sequence for sr in sched.scheduled))
        return execute(sched)

    engine.runner.execute = recording_execute
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, PoolingParams(task="classify"))
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished  # a classify request reports once, when done
            done[out.request_id] = out
    assert ending_together >= 2
    for i, p in enumerate(prompts):
        assert done[f"c{i}"].prompt_token_ids == p
        assert_matches(done[f"c{i}"], hf, ("negative", "neutral", "positive"))
    assert engine.get_stats().generation_tokens == 0
    assert_no_leaks(engine)


def test_preempted_in_the_middle_of_its_prompt(classifier) -> None:  # noqa: ANN001
    # One seat: a more urgent request (priority 0) takes it from one whose 40-token prompt
    # has 32 tokens done (16 a step; the third step has budget left for the newcomer); the
    # victim is recomputed from its first token.
    folder, hf = classifier
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4, max_num_seqs=1,
                       max_num_batched_tokens=16, enable_prefix_caching=False)
    victims: list[str] = []
    preempt = engine.scheduler._preempt

    def recording_preempt(req):  # noqa: ANN001, ANN202
        victims.append((req.request_id, req.num_computed_tokens))
        preempt(req)

    engine.scheduler._preempt = recording_preempt
    slow, urgent = random_prompts(4, 2, longest=1)
    slow, urgent = slow + list(range(200, 239)), urgent + list(range(300, 319))
    engine.add_request("slow", slow, PoolingParams(task="classify"), priority=1)
    engine.step()
    engine.step()
    engine.add_request("urgent", urgent, PoolingParams(task="classify"), priority=0)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert victims == [("slow", 32)]
    assert_matches(done["slow"], hf, ("negative", "neutral", "positive"))
    assert_matches(done["urgent"], hf, ("negative", "neutral", "positive"))
    assert_no_leaks(engine)


def test_prefix_cache_hit(classifier) -> None:  # noqa: ANN001
    folder, hf = classifier
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    prompt = random_prompts(5, 1, longest=1)[0] + list(range(100, 130))
    [first] = llm.classify([prompt])
    [again] = llm.classify([prompt])  # the cached blocks: only the last block is computed
    assert again.num_cached_tokens > 0
    assert again.classification.logits == pytest.approx(first.classification.logits, abs=1e-5)
    assert_matches(again, hf, ("negative", "neutral", "positive"))
    assert_no_leaks(llm.engine)


def test_bfloat16_is_close_to_float32(classifier) -> None:  # noqa: ANN001
    folder, hf = classifier
    llm = LLM(model=str(folder), dtype="bfloat16")
    for o in llm.classify(random_prompts(6, 3)):
        want = hf.logits(o.prompt_token_ids).softmax(dim=0)
        assert (torch.tensor(o.classification.probs) - want).abs().max() < 0.1


def test_what_a_classifier_refuses(cross_encoder, random_llama_dir) -> None:  # noqa: ANN001
    folder, _ = cross_encoder
    llm = LLM(model=str(folder), dtype="float32")
    with pytest.raises(ValueError, match="^model: .*sequence-classification.*not generation"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^model: .*sequence-classification.*not embeddings"):
        llm.embed([1, 2, 3])
    assert_no_leaks(llm.engine)
    with pytest.raises(ValueError, match="^speculative: a headless embedding or a classif"):
        LLM(model=str(folder), dtype="float32", speculative="ngram")
    causal = LLM(model=str(random_llama_dir), dtype="float32")
    with pytest.raises(ValueError, match="^model: .* has no classification head"):
        causal.classify("hello")
    assert_no_leaks(causal.engine)


def test_bad_pooling_params() -> None:
    with pytest.raises(ValueError, match="^task must be one of"):
        PoolingParams(task="score")
    with pytest.raises(ValueError, match="^pooling: task 'classify' reads the head at the last"):
        PoolingParams(task="classify", pooling="mean")
    assert PoolingParams().task == "embed"


@pytest.mark.parametrize("problem_type,num_labels", [("multi_label_classification", 3),
                                                     ("regression", 2),
                                                     ("single_label_classification", 3)])
def test_probs_follow_problem_type_as_transformers_pipeline(
        problem_type: str, num_labels: int, tmp_path: Path) -> None:
    """`probs` as transformers' text-classification pipeline scores each label from
    config.json `problem_type`: a multi-label head's labels each through a sigmoid (they
    were a softmax, so independent labels competed), a regression head's values as they are."""
    from transformers import pipeline

    folder = make_random_model_dir(tmp_path, "qwen2", num_labels=num_labels,
                                   extra_config={"problem_type": problem_type})
    texts = ["The capital of France is Paris.", "I did not like it at all"]
    reference = pipeline("text-classification", model=str(folder), top_k=None,
                         dtype=torch.float32)
    outs = LLM(model=str(folder), dtype="float32").classify(texts)
    for text, out in zip(texts, outs, strict=True):
        want = {r["label"]: r["score"] for r in reference([text])[0]}
        got = out.classification
        assert dict(zip(LABELS_OF[num_labels], got.probs, strict=True)) == pytest.approx(
            want, abs=1e-5)
        assert got.label == max(want, key=want.get)
    if problem_type == "multi_label_classification":
        assert sum(outs[0].classification.probs) != pytest.approx(1.0, abs=1e-3)


LABELS_OF = {n: tuple(f"LABEL_{i}" for i in range(n)) for n in (2, 3)}


def test_an_unknown_problem_type_is_refused(tmp_path: Path) -> None:
    folder = make_random_model_dir(tmp_path, "qwen2", num_labels=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "problem_type": "ranking"}))
    with pytest.raises(ValueError, match="problem_type must be one of"):
        LLM(model=str(folder), dtype="float32")
