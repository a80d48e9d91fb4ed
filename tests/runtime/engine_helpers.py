"""Helpers shared by engine-level tests (import with tests/runtime on sys.path)."""

from __future__ import annotations

import random

from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from argosy_runtime.scheduler import Scheduler, SchedulerOutput


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block is back in the pool (cached-free counts as free), no block table left, in
    the target's cache and in a separate draft's."""
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, (kv.num_free_blocks, kv.num_blocks)
    assert kv.req_to_blocks == {}
    draft_cache = getattr(getattr(engine.proposer, "proposer", None), "cache", None)
    if draft_cache is not None:  # a separate draft's own blocks (spec_decode/draft_cache.py)
        draft = draft_cache.manager
        assert draft.num_free_blocks == draft.num_blocks, (draft.num_free_blocks, draft.num_blocks)
        assert draft.req_to_blocks == {}


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    """(token ids, the logprob of each) of a RequestOutput's first sequence: what the
    batch-invariant mode must reproduce bit for bit."""
    c = output.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def run_requests(engine: LLMEngine, requests: list[tuple[list[int] | str, SamplingParams]],
                 lora_names: list[str | None] | None = None) -> list:
    """Add (prompt, params) pairs as r0, r1, ... together (request i on the LoRA adapter
    `lora_names[i]`, None: the base model); step until all finish. Their final
    RequestOutputs, in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params,
                           lora_name=lora_names[i] if lora_names else None)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(requests))]


def run_with_arrivals(engine: LLMEngine, reqs: list[dict], max_steps: int) -> dict:
    """Add request i (a dict: prompt, params, priority, lora, arrive and abort steps) as
    "r{i}" at its arrival step, abort it at its abort step; step until done (at most
    `max_steps`: a hang fails). The last output of each request, by id."""
    outputs, step, pending = {}, 0, list(range(len(reqs)))
    while pending or engine.has_unfinished_requests():
        for i in [i for i in pending if reqs[i]["arrive"] <= step]:
            r = reqs[i]
            engine.add_request(f"r{i}", r["prompt"], r["params"], arrival_time=float(i),
                               priority=r["priority"], lora_name=r["lora"])
            pending.remove(i)
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
        for i, r in enumerate(reqs):
            if r["abort"] == step and i not in pending:
                engine.abort_request(f"r{i}")
        assert step < max_steps, "no progress"
    return outputs


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                      abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Add prompts as r0, r1, ...; step until done, aborting `{request_id: at_step}`.
    Returns the output token ids of every request that finished."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(rid)
    return done


def fail_the_nth_step(engine: LLMEngine, monkeypatch, n: int) -> None:  # noqa: ANN001
    """The model runner's n-th step from now on raises RuntimeError("injected step
    failure"); the others run."""
    execute = engine.runner.execute
    calls = 0

    def fails_on_the_nth_call(sched):  # noqa: ANN001, ANN202
        nonlocal calls
        calls += 1
        if calls == n:
            raise RuntimeError("injected step failure")
        return execute(sched)

    monkeypatch.setattr(engine.runner, "execute", fails_on_the_nth_call)


def record_cpp_layer_calls(monkeypatch) -> list[int]:  # noqa: ANN001
    """From now on, the row count of every step that runs the C++ decode layers
    (CpuDecodeLayers), for tests that must prove the C++ path ran or did not."""
    calls: list[int] = []
    original = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, h, *args: calls.append(h.shape[0]) or original(self, h, *args))
    return calls


class FullForwardReference:
    """transformers' greedy continuation and the log-softmax at each step, one full forward
    per token (no KV cache): the model's own mask alone decides what each position sees
    (sliding windows), and position-dependent rope (longrope) is computed from the whole
    sequence. Cached per (prompt, n)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.model = model
        self._cache: dict = {}

    @classmethod
    def from_folder(cls, folder) -> FullForwardReference:  # noqa: ANN001
        import torch
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval())

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list]:
        import torch

        key = (tuple(prompt), n)
        if key not in self._cache:
            ids, logprobs = list(prompt), []
            with torch.no_grad():
                for _ in range(n):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    logprobs.append(torch.log_softmax(logits, dim=-1))
                    ids.append(int(logprobs[-1].argmax()))
            self._cache[key] = (ids[len(prompt):], logprobs)
        return self._cache[key]


def scheduler_step(s: Scheduler) -> SchedulerOutput:
    """Schedule and advance like the engine would (one sampled token, 7, per completed
    sequence), without a model: for scheduler tests."""
    out = s.schedule()
    for sr in out.scheduled:
        done = sr.completes_sequence
        sr.request.num_computed_tokens += sr.num_new_tokens
        if done:
            sr.request.token_ids.append(7)
    return out


def greedy(n: int) -> SamplingParams:
    """n greedy tokens, EOS ignored, with the chosen token's logprob."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_equals_reference(outputs, prompts, ref: FullForwardReference, n: int) -> None:  # noqa: ANN001
    """Each output's greedy tokens equal the reference's, logprobs within 1e-4."""
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = ref.greedy(prompt, n)
        seq = out.outputs[0]
        assert seq.token_ids == tokens, len(prompt)
        for pos, token in enumerate(tokens):
            assert abs(seq.logprobs[pos][token].logprob - logprobs[pos][token].item()) < 1e-4


def check_prefix_hits_and_preemption(engine: LLMEngine, ref: FullForwardReference,
                                     prompts: list[list[int]], n: int) -> None:
    """Run `prompts` (sharing a prefix) together on an engine whose KV pool is too small for
    all of them: some must hit the prefix cache and some be preempted, and every output still
    equals the reference, with no block leaked."""
    outputs = run_requests(engine, [(p, greedy(n)) for p in prompts])
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_equals_reference(outputs, prompts, ref, n)
    assert_no_leaks(engine)


def check_window_prefix_hits_and_preemption(folder, ref: FullForwardReference,  # noqa: ANN001
                                            bytes_per_token: int, num_blocks: int,
                                            shared_len: int, tails: tuple[int, ...],
                                            n: int) -> None:
    """check_prefix_hits_and_preemption for a sliding-window model (float32, 4-token blocks,
    8-token steps, a pool of `num_blocks` blocks): prompts sharing a prefix longer than the
    window, so cache hits start a chunk mid-window, and preempted requests recompute."""
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4,
                       max_num_batched_tokens=8, kv_cache_memory=num_blocks * 4 * bytes_per_token)
    shared = random_prompts(3, (shared_len,))[0]
    prompts = [shared + tail for tail in random_prompts(4, tails)]
    check_prefix_hits_and_preemption(engine, ref, prompts, n)


def assert_dynamic_rope_gguf_and_gptq_refused(folder, architecture: str, tmp_path) -> None:  # noqa: ANN001
    """A Llama-decoder variant's refusals, each a ValueError naming what is refused: dynamic
    rope scaling, a llama.cpp file of its general.architecture, GPTQ calibration (its
    forward is Llama's layer)."""
    import pytest
    import torch
    from argosy_runtime import LLM
    from argosy_runtime.model_loader import load_checkpoint
    from argosy_runtime.models.build import build_model
    from argosy_runtime.quantization import QuantizationConfig
    from model_factory import write_tiny_gguf

    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        LLM(model=str(folder), dtype="float32", hf_overrides=dynamic)
    with pytest.raises(ValueError,
                       match=f"GGUF general.architecture '{architecture}' is not supported"):
        LLM(model=str(write_tiny_gguf(tmp_path / f"{architecture}.gguf", architecture)))
    with pytest.raises(ValueError, match=f"GPTQ calibration does not support {architecture}"):
        build_model(load_checkpoint(str(folder)), torch.float32, torch.device("cpu"), 64,
                    QuantizationConfig("int4", algorithm="gptq"))
