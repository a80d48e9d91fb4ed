"""Tensor parallelism end to end: real worker processes, real gloo all-reduces, compared with
transformers (float32) and with the single-process engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.async_engine import AsyncEngine
from argosy_runtime.distributed import TensorParallelWorkers, WorkerConfig
from engine_helpers import (
    FullForwardReference,
    assert_equals_reference,
    check_prefix_hits_and_preemption,
    greedy,
    random_prompts,
    run_requests,
)
from model_factory import make_random_model_dir


def _stop(engine: LLMEngine) -> None:
    engine.shutdown()
    assert all(not p.is_alive() for p in engine.tensor_parallel_workers._procs)


@pytest.fixture(scope="module")
def embedded_reference(embedded_hf) -> FullForwardReference:
    return FullForwardReference(embedded_hf.model)


def test_embedded_model_over_three_ranks_equals_transformers(embedded_reference) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) as 3 ranks of 3 heads / 1 KV head: greedy tokens and
    logprobs equal transformers through chunked prefill, prefix-cache hits and preemption."""
    # Per token and rank: 30 layers x (K, V) x 1 KV head x 64 dims x 4 bytes = 15360 bytes.
    engine = LLMEngine(model="smollm2-135m", dtype="float32", tensor_parallel_size=3,
                       block_size=4, max_num_batched_tokens=8, kv_cache_memory=30 * 4 * 15360)
    try:
        assert engine.cache_config.num_blocks == 30
        assert engine.model.spec.num_attention_heads == 3
        assert engine.model.cpu_decode is None  # the C++ layers have no all-reduce
        shared = random_prompts(0, (22,))[0]
        prompts = [shared + tail for tail in random_prompts(1, (3, 9, 1, 14, 6, 11))]
        check_prefix_hits_and_preemption(engine, embedded_reference, prompts, 12)
    finally:
        _stop(engine)
    assert engine.tensor_parallel_workers._procs  # there were workers, and they are gone


def test_moe_with_bias_and_shared_expert_over_two_ranks(tmp_path) -> None:
    """Qwen2-MoE: q/k/v biases split with their rows, every expert's and the shared expert's
    columns split, the router and the shared expert's gate replicated."""
    folder = make_random_model_dir(
        tmp_path, "qwen2_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, extra_config=dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, decoder_sparse_step=2))
    ref = FullForwardReference.from_folder(folder)
    prompts = random_prompts(2, (5, 19), vocab=ref.model.config.vocab_size)
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        assert_equals_reference(run_requests(engine, [(p, greedy(6)) for p in prompts]),
                                prompts, ref, 6)
    finally:
        _stop(engine)


def test_fewer_kv_heads_than_ranks_are_replicated_over_four_ranks(tmp_path) -> None:
    """8 query heads in 2 KV groups over 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV
    head 1 (with its q/k/v biases, Qwen2), and the tokens are still transformers' greedy ones."""
    folder = make_random_model_dir(tmp_path, "qwen2", num_hidden_layers=2, hidden_size=64,
                                   num_attention_heads=8, num_key_value_heads=2)
    ref = FullForwardReference.from_folder(folder)
    prompts = random_prompts(3, (7, 15), vocab=ref.model.config.vocab_size)
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=4)
    try:
        assert engine.model.spec.num_key_value_heads == 1
        assert_equals_reference(run_requests(engine, [(p, greedy(6)) for p in prompts]),
                                prompts, ref, 6)
    finally:
        _stop(engine)


def test_ngram_speculative_decoding_over_three_ranks(embedded_reference) -> None:
    """Verification chunks (1 + k tokens per sequence) go to the workers like prompt chunks:
    on a prompt the model continues by copying, drafts are proposed and accepted, and the
    tokens are still transformers' greedy ones."""
    engine = LLMEngine(model="smollm2-135m", dtype="float32", tensor_parallel_size=3,
                       speculative="ngram")
    try:
        prompt = engine.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,")
        assert_equals_reference(run_requests(engine, [(prompt, greedy(16))]), [prompt],
                                embedded_reference, 16)
        assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        _stop(engine)


def test_int8_bfloat16_ranks_match_one_process(tmp_path) -> None:
    """int8 weights in bfloat16 (the CPU's packed and fused kernels) over two ranks score a
    prompt like the one-process engine: the shards quantize their own rows and columns, and
    the all-reduce adds bfloat16 partial sums, so close, not equal."""
    folder = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2, init_std=0.05)
    prompt = random_prompts(3, (40,), vocab=1000)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scores = []
    for size in (1, 2):
        engine = LLMEngine(model=str(folder), dtype="bfloat16", quantization="int8",
                           tensor_parallel_size=size)
        try:
            out = run_requests(engine, [(prompt, params)])[0]
            scores.append([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        finally:
            engine.shutdown()
    diffs = [abs(a - b) for a, b in zip(*scores)]
    assert max(diffs) < 0.1, max(diffs)


def test_a_killed_worker_fails_the_step_instead_of_hanging(tmp_path) -> None:
    folder = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        run_requests(engine, [([5, 6, 7], greedy(2))])
        with pytest.raises(ValueError, match="tensor_parallel_size"):  # /v1/load_lora_adapter
            engine.load_lora_adapter("late", str(tmp_path))
        worker = engine.tensor_parallel_workers._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        engine.add_request("after", [5, 6, 7, 8], greedy(2))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel worker|Connection closed"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 30
        assert not engine.tensor_parallel_workers.is_alive
        # /health reads the async engine's is_alive: its thread runs on, but no step can, so
        # the liveness probe must restart the pod (every request was a 503 forever).
        async def health() -> bool:
            async_engine = AsyncEngine(engine)
            async_engine.start()
            try:
                return async_engine.is_alive
            finally:
                async_engine.shutdown()

        assert not asyncio.run(health())
    finally:
        engine.shutdown()


def _fail_once(module: object, name: str) -> None:
    """Make `module.name` raise a MemoryError on its next call only (rank 0 out of memory)."""
    original = getattr(module, name)

    def fail(*args, **kwargs):
        setattr(module, name, original)
        raise MemoryError("rank 0 out of memory")

    setattr(module, name, fail)


def test_a_rank_0_step_failing_partway_stops_the_engine_instead_of_wrong_tokens(
        tmp_path) -> None:
    """Rank 0's forward raising between its all-reduces (the server then serves on) left the
    workers waiting inside that step: the next step's all-reduces met the old step's, so the
    next request got wrong tokens without an error, then gloo aborted the whole process."""
    folder = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)
    prompt = [5, 6, 7, 8]
    expected = run_requests(LLMEngine(model=str(folder), dtype="float32"),
                            [(prompt, greedy(3))])[0].outputs[0].token_ids
    engine = LLMEngine(model=str(folder), dtype="float32", tensor_parallel_size=2)
    try:
        # A failure after the forward (the ranks stay in step) leaves the engine serving.
        _fail_once(engine.model, "compute_logits")
        engine.add_request("late", prompt, greedy(3))
        with pytest.raises(MemoryError):
            engine.step()
        engine.abort_request("late")
        assert run_requests(engine, [(prompt, greedy(3))])[0].outputs[0].token_ids == expected
        assert engine.tensor_parallel_workers.is_alive
        # One between the all-reduces (layer 1's attention, after layer 0's two) does not.
        _fail_once(engine.model.model.layers[1].self_attn, "forward")
        engine.add_request("partway", prompt, greedy(3))
        with pytest.raises(MemoryError):
            engine.step()
        engine.abort_request("partway")
        for _ in range(2):  # and every later step says so
            engine.add_request("next", prompt, greedy(3))
            with pytest.raises(RuntimeError, match="ranks are out of step"):
                engine.step()
            engine.abort_request("next")
        assert not engine.tensor_parallel_workers.is_alive
    finally:
        _stop(engine)


def _workers(model: str) -> TensorParallelWorkers:
    return TensorParallelWorkers(WorkerConfig(
        model=model, hf_overrides=None, dtype=torch.float32, device_type="cpu",
        max_model_len=64, quant_config=None, cpu_threads=1, world_size=2,
        kv_cache_memory_fraction=0.9))


def test_a_worker_that_fails_to_load_raises_its_traceback(tmp_path) -> None:
    workers = _workers(str(tmp_path / "no-such-model"))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)argosy-tp-rank1 failed.*no-such-model"):
            workers.wait_ready()
    finally:
        workers.close(timeout=2)


def test_a_worker_lost_before_the_group_forms_raises_at_once(tmp_path) -> None:
    """Rank 0 joins the all-reduce group while watching the workers: a worker that dies
    there raises within seconds, not after the group's 10-minute rendezvous timeout."""
    workers = _workers(str(make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)))
    try:
        assert workers.wait_ready() == [None]  # CPU ranks report no KV budget
        os.kill(workers._procs[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited before it was connected"):
            workers.connect(torch.device("cpu"))
        assert time.monotonic() - started < 10
    finally:
        workers.close(timeout=2)


def test_workers_stopped_before_their_cache_is_allocated_exit_cleanly(tmp_path) -> None:
    """The engine fails after the shards loaded (a KV cache too small for one block, a draft
    model or adapter that does not load): each worker took the "stop" for its cache config
    and died on an AttributeError, a traceback per worker after the engine's one-line error."""
    workers = _workers(str(make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)))
    try:
        workers.wait_ready()
        workers.connect(torch.device("cpu"))
    finally:
        workers.close(timeout=10)
    assert [proc.exitcode for proc in workers._procs] == [0]


def test_options_that_cannot_be_split_are_refused_before_loading(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads 9"):
        LLMEngine(model="smollm2-135m", tensor_parallel_size=2)
    folder = make_random_model_dir(tmp_path, "llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="LoRA adapters"):
        LLMEngine(model=str(folder), tensor_parallel_size=2, lora_modules={"a": str(tmp_path)})
    with pytest.raises(ValueError, match="self-draft"):
        LLMEngine(model=str(folder), tensor_parallel_size=2, speculative="draft")
    with pytest.raises(ValueError, match="batch_invariant"):
        LLMEngine(model=str(folder), tensor_parallel_size=2, batch_invariant=True,
                  dtype="bfloat16")
