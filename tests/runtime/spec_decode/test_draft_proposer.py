"""Draft-model proposer: self-draft and separate drafts give exactly the target's greedy output,
across preemption and prefix-cache hits, without leaking KV blocks."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime: model_factory

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from engine_helpers import assert_no_leaks  # noqa: E402
from engine_helpers import run_to_completion as run  # noqa: E402
from model_factory import EMBEDDED_EOS_ID, make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
# Tight pool (20 blocks of 4 tokens, 2 KiB each, for 6 requests of up to ~56 tokens) and small
# chunks: requests get preempted and come back through prefix-cache hits on their own blocks
# and on the prefix all prompts share.
TIGHT = dict(dtype="float32", block_size=4, kv_cache_memory=20 * 2048, max_num_batched_tokens=16)
TIGHT_BLOCKS = 20


def prompts(n: int, seed: int) -> list[list[int]]:
    """A shared 12-token prefix, then a repeated random phrase (n-gram-like structure)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(12)]
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 6))]
        out.append(prefix + phrase * rng.randint(2, 4))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    target = make_random_model_dir(root, "llama", num_hidden_layers=2)
    # "copy": the target's weights as a separate draft (own cache, lazy catch-up): every
    # draft must be accepted. "near": every weight perturbed by 1% of its std, so drafts are
    # often but not always right (accepted runs and rejections in one run).
    copy = root / "copy"
    shutil.copytree(target, copy)
    near = root / "near"
    shutil.copytree(target, near)
    gen = torch.Generator().manual_seed(1)
    for file in near.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k: v + 0.01 * v.std() * torch.randn(v.shape, generator=gen)
                   for k, v in tensors.items()}, file, metadata={"format": "pt"})
    small = make_random_model_dir(root, "llama", name="small", num_hidden_layers=1,
                                  hidden_size=32, intermediate_size=64, seed=5)
    return {"target": target, "copy": copy, "near": near, "small": small}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, list[int]]:
    return run(LLMEngine(model=str(models["target"]), dtype="float32", block_size=4),
               prompts(6, 0), GREEDY)


def draft_block_bytes(folder: Path) -> int:
    """Bytes of a float32 cache block of 4 tokens over every layer of the model in `folder`."""
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 4 * 2 * c["num_hidden_layers"] * c.get("num_key_value_heads",
                                                   c["num_attention_heads"]) * head_dim * 4


def tight(kind: str, models: dict[str, Path]) -> dict:
    """TIGHT, with room for a separate draft's cache (it shares the KV budget, a block of
    its own per target block) so that the target keeps its 20 blocks."""
    if kind == "self":
        return TIGHT
    draft = models["target" if kind == "int4" else kind]
    return {**TIGHT, "kv_cache_memory": TIGHT_BLOCKS * (2048 + draft_block_bytes(draft))}


def draft_spec(kind: str, k: int, models: dict[str, Path]) -> dict:
    spec: dict = {"method": "draft", "num_speculative_tokens": k, "adaptive": False}
    if kind == "self":
        spec["draft_layers"] = 1  # half of the 2-layer target
    elif kind == "int4":
        spec["quantization"] = "int4"  # an int4 copy of the target, with its own cache
    else:
        spec["model"] = str(models[kind])
    return spec


@pytest.mark.parametrize("kind,k", [("self", k) for k in range(1, 9)]
                         + [("near", k) for k in (1, 4, 8)] + [("copy", 3), ("small", 3), ("int4", 2)])
def test_greedy_draft_speculation_is_exact(kind: str, k: int, models: dict[str, Path],
                                           reference: dict[str, list[int]]) -> None:
    engine = LLMEngine(model=str(models["target"]), **tight(kind, models),
                       speculative=draft_spec(kind, k, models))
    assert engine.kv_cache.num_blocks == TIGHT_BLOCKS
    assert run(engine, prompts(6, 0), GREEDY) == reference
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.num_preemptions > 0
    assert engine.kv_cache.prefix_cache_hits > 0
    if kind == "near":  # both accepted runs and rejections happened (~25-60% accepted)
        assert 0.15 * stats.spec_decode_num_draft_tokens < stats.spec_decode_num_accepted_tokens
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if kind == "copy":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert_no_leaks(engine)


def test_full_depth_self_draft_is_always_accepted(models: dict[str, Path],
                                                  reference: dict[str, list[int]]) -> None:
    # All target layers as the draft: it reads the target's own cache, so every draft must
    # be the target's argmax. Any stale or misplaced K/V would show up as a rejection.
    engine = LLMEngine(model=str(models["target"]), dtype="float32", block_size=4,
                       speculative={"method": "draft", "draft_layers": 2,
                                    "num_speculative_tokens": 5, "adaptive": False})
    assert run(engine, prompts(6, 0), GREEDY) == reference
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("kind", ["self", "near"])
def test_sampled_requests_with_aborts_leave_no_blocks_and_are_reproducible(
        kind: str, models: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)

    def sample() -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(model=str(models["target"]), **tight(kind, models),
                           speculative={**draft_spec(kind, 4, models), "adaptive": True})
        return run(engine, prompts(5, 3), params, abort_after={"r1": 2, "r3": 4}), engine

    first, engine = sample()
    assert sorted(first) == ["r0", "r2", "r4"]
    assert all(len(t) == 24 for t in first.values())
    assert engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)
    assert sample()[0] == first


def test_a_draft_short_of_blocks_leaves_requests_undrafted_and_stays_exact(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A separate draft's cache shares the KV budget, a block of its own per target block
    (16 each here), but not the target's prefix cache: four requests on one 16-token prompt
    share its 4 blocks in the target and hold a copy each in the draft. The draft runs short:
    it gives up the K/V of requests not drafting this step first (when that makes room),
    else leaves a request undrafted. The output is still the target's alone, and both pools end empty."""
    from argosy_runtime.spec_decode.draft_proposer import DraftProposer

    allocated: list[tuple[bool, int]] = []  # per allocation: done?, running requests freed
    forgotten_running: list[str] = []
    allocate, forget = DraftProposer._allocate_draft_blocks, DraftProposer.forget

    def spy_allocate(self, request_id, num_tokens, start, drafting):  # noqa: ANN001, ANN202
        before = len(forgotten_running)
        done = allocate(self, request_id, num_tokens, start, drafting)
        allocated.append((done, len(forgotten_running) - before))
        return done

    def spy_forget(self, request_id):  # noqa: ANN001, ANN202
        if request_id in self.engine.scheduler.requests:
            forgotten_running.append(request_id)
        forget(self, request_id)

    monkeypatch.setattr(DraftProposer, "_allocate_draft_blocks", spy_allocate)
    monkeypatch.setattr(DraftProposer, "forget", spy_forget)
    prompt = prompts(1, 5)[0][:16]
    requests = [prompt] * 4
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 8, 10, 12)]
    options = dict(dtype="float32", block_size=4, kv_cache_memory=16 * (2048 + 2048))
    plain = LLMEngine(model=str(models["target"]), **options)
    expected = [run(plain, [p], q)["r0"] for p, q in zip(requests, params)]
    engine = LLMEngine(model=str(models["target"]), **options,
                       speculative=draft_spec("copy", 3, models))
    assert engine.kv_cache.num_blocks == engine.proposer.proposer.cache.manager.num_blocks == 16
    for i, (p, q) in enumerate(zip(requests, params)):
        engine.add_request(f"r{i}", p, q)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert [outputs[f"r{i}"] for i in range(4)] == expected
    assert {done for done, _ in allocated} == {True, False}
    assert forgotten_running  # a running request's draft K/V made room
    # ... and only when that was enough: no request lost its K/V for nothing.
    assert all(done for done, freed in allocated if freed)
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(engine)


def test_draft_with_another_vocabulary_is_rejected(models: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(models["small"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(config))
    for file in other.glob("*.safetensors"):
        save_file({k: v[:1000] if v.shape[0] == 49152 else v for k, v in load_file(file).items()},
                  file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="vocab_size"):
        LLMEngine(model=str(models["target"]), dtype="float32",
                  speculative={"method": "draft", "model": str(other)})


@pytest.mark.parametrize("spec,field", [
    ({"method": "draft", "draft_layers": 3}, "draft_layers"),
    ({"method": "draft", "draft_layers": 0}, "draft_layers"),
    ({"method": "draft", "quantization": "int3"}, "quantization"),
    ({"method": "ngram", "model": "x"}, "method 'draft'"),
    ({"method": "ngram", "model": ""}, "model must be a path"),
    ({"method": "draft", "model": " "}, "model must be a path"),
])
def test_bad_draft_options_name_the_field(spec: dict, field: str, models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=field):
        LLMEngine(model=str(models["target"]), dtype="float32", speculative=spec)


PASSAGE = (
    "The Apollo program was the third United States human spaceflight program carried out by "
    "NASA, which succeeded in preparing and landing the first humans on the Moon from 1968 to "
    "1972."
)


def test_embedded_model_self_draft_matches_plain_decoding() -> None:
    # SmolLM2 was not trained for early exit: its first 7 of 30 layers + head rarely guess
    # the next token (measured 0/82 accepted; 7/60 with 22 layers; 18/18 with all 30), so
    # this checks exactness and cache sharing on a real model, not acceptance.
    from argosy_runtime import LLM

    messages = [[{"role": "user", "content": f"Copy this text exactly:\n\n{PASSAGE}"}]]
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = LLM(model="smollm2-135m", dtype="float32", max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in plain.chat(messages, params)]
    del plain
    spec = LLM(model="smollm2-135m", dtype="float32", max_num_batched_tokens=64,
               speculative={"method": "draft", "num_speculative_tokens": 4, "adaptive": False})
    got = [o.outputs[0].token_ids for o in spec.chat(messages, params)]
    assert got == expected
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert_no_leaks(spec.engine)


def test_adaptive_k_shrinks_for_a_bad_draft_and_stays_full_for_a_good_one(
        models: dict[str, Path], reference: dict[str, list[int]]) -> None:
    def stats_for(kind: str, adaptive: bool):  # noqa: ANN202
        engine = LLMEngine(model=str(models["target"]), dtype="float32", block_size=4,
                           speculative={**draft_spec(kind, 4, models), "adaptive": adaptive})
        assert run(engine, prompts(6, 0), GREEDY) == reference
        return engine.get_stats()

    bad_fixed, bad = stats_for("small", False), stats_for("small", True)
    assert bad.spec_decode_num_accepted_tokens < 0.1 * bad.spec_decode_num_draft_tokens
    # The unrelated draft is nearly always wrong: adaptive k drafts a fraction of what fixed
    # k = 4 does (one probe token at a time, then cooldowns).
    assert bad.spec_decode_num_draft_tokens < 0.25 * bad_fixed.spec_decode_num_draft_tokens
    good = stats_for("copy", True)
    # A draft that is always right keeps k = 4: 6 requests x 20 tokens in steps of up to 5.
    assert good.spec_decode_num_accepted_tokens == good.spec_decode_num_draft_tokens
    assert good.spec_decode_num_draft_tokens >= 0.7 * good.generation_tokens


def test_under_ignore_eos_a_draft_goes_on_past_the_end_token(models: dict[str, Path]) -> None:
    """ignore_eos: the model's end token ends nothing, so drafting stops at it no more; it
    did, and a request whose text is end tokens verified one draft token a step, not k."""
    engine = LLMEngine(model=str(models["target"]), dtype="float32", block_size=4,
                       speculative={"method": "draft", "draft_layers": 1,
                                    "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True,
                            logit_bias={EMBEDDED_EOS_ID: 100})  # target and draft: EOS first
    engine.add_request("r", list(range(5, 13)), params)
    steps, out = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == [EMBEDDED_EOS_ID] * 11
    stats = engine.get_stats()
    # the prefill's token, then two steps of 4 accepted drafts + 1 (was 5 steps of 1 + 1)
    assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_accepted_tokens == 8
    assert steps == 3
    assert_no_leaks(engine)
