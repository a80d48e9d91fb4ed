"""Sliding-window checkpoints (Mistral-7B v0.1; Qwen2 with use_sliding_window, windowed from
layer max_window_layers on) served past their window with windowed attention: a query at
position p of a windowed layer sees the keys p - W < k <= p, as transformers' mask does.

Tiny random models with windows of a few blocks (block_size 4), prompts and generations well
past the window: greedy tokens and logprobs equal transformers' in float32 through chunked
prefill, prefix-cache hits and preemption; bfloat16 (the fused C++ kernels and decode layers)
and an int8 KV cache stay close to it."""

from __future__ import annotations

import pytest
import torch
from argosy_runtime import LLM, LLMEngine
from argosy_runtime.model_runner import kv_cache_bytes_per_block
from engine_helpers import (
    FullForwardReference,
    assert_equals_reference,
    assert_no_leaks,
    check_window_prefix_hits_and_preemption,
    greedy,
    random_prompts,
)
from model_factory import make_random_model_dir

MISTRAL_WINDOW = 10  # ends inside a block of 4
QWEN2_WINDOW = 12  # ends on a block boundary
MAX_POSITIONS = 256


def windowed_dir(tmp_path, arch: str, window: int | None, **kwargs):  # noqa: ANN001, ANN201
    """A random `arch` folder whose config windows attention. Qwen2: 3 layers, the first full
    and the other two windowed (max_window_layers 1)."""
    if arch == "mistral":
        extra = {"sliding_window": window}
    else:
        extra = {"sliding_window": window, "use_sliding_window": window is not None,
                 "max_window_layers": 1}
        kwargs.setdefault("num_hidden_layers", 3)
    return make_random_model_dir(tmp_path, arch, name=f"{arch}-window-{window}",
                                 max_position_embeddings=MAX_POSITIONS, extra_config=extra,
                                 **kwargs)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = windowed_dir(tmp_path_factory.mktemp("models"), "mistral", MISTRAL_WINDOW)
    return folder, FullForwardReference.from_folder(folder)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = windowed_dir(tmp_path_factory.mktemp("models"), "qwen2", QWEN2_WINDOW)
    return folder, FullForwardReference.from_folder(folder)


def test_the_window_changes_attention_beyond_it(tmp_path) -> None:  # noqa: ANN001
    """Why the window must be honoured: past it, transformers' windowed model and full
    attention disagree (equal, bit for bit, before it)."""
    windowed = FullForwardReference.from_folder(windowed_dir(tmp_path, "mistral", MISTRAL_WINDOW)).model
    full = FullForwardReference.from_folder(windowed_dir(tmp_path, "mistral", None)).model
    ids = torch.tensor(random_prompts(4, (4 * MISTRAL_WINDOW,)))
    with torch.no_grad():
        a, b = windowed(ids).logits[0], full(ids).logits[0]
    assert torch.equal(a[:MISTRAL_WINDOW], b[:MISTRAL_WINDOW])
    assert bool(((a[MISTRAL_WINDOW:] - b[MISTRAL_WINDOW:]).abs().amax(dim=1) > 0).all())


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_past_the_window_equals_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    """Prompts shorter than, equal to and several times the window, 24 generated tokens each,
    batched, in prefill chunks of 16 tokens (a chunk after cached tokens crosses the window)."""
    folder, ref = request.getfixturevalue(arch)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    window = MISTRAL_WINDOW if arch == "mistral" else QWEN2_WINDOW
    expected = (window,) * 2 if arch == "mistral" else (None, window, window)
    assert spec.layer_sliding_windows == expected
    assert llm.engine.max_model_len == MAX_POSITIONS  # no longer capped at the window
    prompts = random_prompts(1, (1, window - 1, window, window + 1, 23, 45))
    assert_equals_reference(llm.generate(prompts, greedy(24)), prompts, ref, 24)
    assert_no_leaks(llm.engine)


def test_whole_prompts_in_one_chunk_and_one_token_chunks(qwen2) -> None:  # noqa: ANN001
    folder, ref = qwen2
    prompts = random_prompts(2, (30, 17))
    for budget in (256, 1):  # a 30-token prompt at once; then prompts a token per step
        llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=budget,
                  max_num_seqs=2)
        assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)
        assert_no_leaks(llm.engine)


def test_prefix_hits_and_preemption(mistral) -> None:  # noqa: ANN001
    """A shared prefix longer than the window (cache hits start a chunk mid-window, found
    from the blocks the window reads) and a KV pool too small for all requests (preempted
    ones recompute). 16 blocks: each request holds at most 6 (blocks behind the window are
    released), so a pool of 30 no longer preempts."""
    folder, ref = mistral
    # Per token: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes.
    check_window_prefix_hits_and_preemption(folder, ref, 512, 16, 22, (3, 9, 1, 14, 6, 11), 20)


@pytest.fixture(scope="module")
def mistral_64(tmp_path_factory):  # noqa: ANN001, ANN201
    """head_dim 64: the C++ prefill kernel's size, so bfloat16 runs every fused C++ kernel.
    Smaller weights than the other models: bf16 rounding then moves logprobs by a few 0.01
    instead of tenths, well below what the window changes."""
    folder = windowed_dir(tmp_path_factory.mktemp("models"), "mistral", MISTRAL_WINDOW,
                          head_dim=64, init_std=0.15)
    return folder, FullForwardReference.from_folder(folder)


def test_bfloat16_fused_cpu_kernels_stay_close(mistral_64) -> None:  # noqa: ANN001
    """bf16 on the CPU: prompt chunks through cpu_ops.varlen_attention, decode steps through
    the C++ decode layers (cpu_ops.decode_layer) and cpu_ops.decode_attention, each with the
    window. Full attention would put positions past the window far off."""
    folder, ref = mistral_64
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, max_num_batched_tokens=16)
    model = llm.engine.model
    if model.ops != "cpu_ops":
        pytest.skip("the fused C++ kernels did not build here")
    prompts = random_prompts(5, (8, 30, 41))
    outputs = llm.generate(prompts, greedy(12))
    agree = total = 0
    for prompt, out in zip(prompts, outputs):
        tokens, logprobs = ref.greedy(prompt, 12)
        seq = out.outputs[0]
        # Until the first disagreement the contexts are equal: compare logprobs there.
        for pos, (got, want) in enumerate(zip(seq.token_ids, tokens)):
            total += 1
            agree += got == want
            assert abs(seq.logprobs[pos][got].logprob - logprobs[pos][got].item()) < 0.08
            if got != want:
                break
    assert agree >= total - 2  # a bf16 near-tie may flip one
    assert_no_leaks(llm.engine)
    # The tolerance is tight enough to tell the window from full attention.
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                sliding_window=None).eval()
    with torch.no_grad():
        full_lp = torch.log_softmax(full(torch.tensor([prompts[2]])).logits[0, -1], dim=-1)
    assert (full_lp - ref.greedy(prompts[2], 1)[1][0]).abs().max() > 0.3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_cache_stays_close(mistral_64, dtype: str) -> None:  # noqa: ANN001
    folder, ref = mistral_64
    llm = LLM(model=str(folder), dtype=dtype, block_size=4, kv_cache_dtype="int8",
              max_num_batched_tokens=16)
    prompts = random_prompts(6, (5, 33))
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(16))):
        tokens, logprobs = ref.greedy(prompt, 16)
        seq = out.outputs[0]
        for pos, (got, want) in enumerate(zip(seq.token_ids, tokens)):
            assert abs(seq.logprobs[pos][got].logprob - logprobs[pos][got].item()) < 0.1
            if got != want:
                break
    assert_no_leaks(llm.engine)


def test_max_model_len_is_the_trained_context(tmp_path) -> None:  # noqa: ANN001
    folder = windowed_dir(tmp_path, "mistral", MISTRAL_WINDOW)
    assert LLM(model=str(folder), dtype="float32", max_model_len=100).engine.max_model_len == 100
    with pytest.raises(ValueError, match=rf"exceeds the model's context length \({MAX_POSITIONS}\)"):
        LLM(model=str(folder), dtype="float32", max_model_len=MAX_POSITIONS + 1)


def test_pure_torch_path_equals_transformers(qwen2) -> None:  # noqa: ANN001
    """Without the C++ kernels (no compiler, ARGOSY_CPU_OPS=0): decode rows through the
    gathered-block SDPA with a windowed mask (one per window: this model has a full layer
    and two windowed ones), prompt chunks through masked SDPA."""
    folder, ref = qwen2
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    llm.engine.model.use_fused_cpu_ops(False)
    llm.engine.runner.backend.fused_cpu_ops = False
    prompts = random_prompts(7, (3, 26, 40))
    assert_equals_reference(llm.generate(prompts, greedy(20)), prompts, ref, 20)
    assert_no_leaks(llm.engine)


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:  # noqa: ANN001
    seq = out.outputs[0]
    return seq.token_ids, [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)]


def test_cpu_decode_layers_equal_the_module_path(mistral_64, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """bfloat16 decode steps through cpu_ops.decode_layer pass each layer's window: the same
    bits as the module path (Attention -> backend -> cpu_ops.decode_attention)."""
    folder, _ = mistral_64
    _cpp_layers_equal_module_path(folder, random_prompts(8, (6, 25, 40)), monkeypatch)


def _cpp_layers_equal_module_path(folder, prompts, monkeypatch) -> LLM:  # noqa: ANN001
    """bfloat16 greedy tokens and logprobs through the C++ decode layers (which must run)
    equal those of the module path, bit for bit. Returns the LLM."""
    from engine_helpers import record_cpp_layer_calls

    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, enable_prefix_caching=False)
    model = llm.engine.model
    if model.cpu_decode is None:
        pytest.skip("the fused C++ kernels did not build here")
    calls = record_cpp_layer_calls(monkeypatch)
    fast = [_tokens_and_logprobs(o) for o in llm.generate(prompts, greedy(16))]
    assert calls, "decode steps took the C++ layers"
    model.cpu_decode = None
    assert [_tokens_and_logprobs(o) for o in llm.generate(prompts, greedy(16))] == fast
    return llm


def test_batch_invariant_mode_with_windows(mistral_64) -> None:  # noqa: ANN001
    """The batch-invariant mode (every query through cpu_ops.varlen_attention, whose key tiles
    start at a task's window): a request's bits alone equal its bits beside others and cut
    into other chunks."""
    from argosy_kernels import cpu_ops

    if not cpu_ops.has_avx512_bf16():
        pytest.skip("the batch-invariant mode needs AVX512-BF16")
    folder, ref = mistral_64
    target, *others = random_prompts(9, (37, 5, 19, 44))
    alone = LLM(model=str(folder), dtype="bfloat16", batch_invariant=True, block_size=4,
                enable_prefix_caching=False)
    expected = _tokens_and_logprobs(alone.generate([target], greedy(16))[0])
    busy = LLM(model=str(folder), dtype="bfloat16", batch_invariant=True, block_size=4,
               enable_prefix_caching=False, max_num_batched_tokens=7)
    outs = busy.generate([*others, target], greedy(16))
    assert _tokens_and_logprobs(outs[-1]) == expected
    tokens, logprobs = ref.greedy(target, 16)
    assert abs(expected[1][0] - logprobs[0][expected[0][0]].item()) < 0.08
    assert_no_leaks(busy.engine)


# ---- blocks released behind the window (kv_cache/sliding_window.py) -------------------------
# The Mistral model windows every layer: blocks behind the window go back to the pool as a
# request advances, so a pool far smaller than the context serves it. 512 bytes per token.
MISTRAL_BYTES_PER_TOKEN = 512


def _windowed_engine(folder, num_blocks: int, **kwargs) -> LLMEngine:  # noqa: ANN001
    """float32, 4-token blocks, 8-token steps, a pool of `num_blocks` blocks (the null block
    among them)."""
    kwargs.setdefault("max_num_batched_tokens", 8)
    return LLMEngine(model=str(folder), dtype="float32", block_size=4,
                     kv_cache_memory=num_blocks * 4 * MISTRAL_BYTES_PER_TOKEN, **kwargs)


def _run_tracking_peak(engine: LLMEngine, prompts: list[list[int]], n: int,
                       abort: dict[str, int] | None = None) -> tuple[dict, int]:
    """Outputs of r0, r1, ... and the most blocks held at once after any step (aborting
    `{request_id: at_step}`)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(n))
    kv, done, peak, steps = engine.kv_cache, {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        steps += 1
        for rid, at in (abort or {}).items():
            if steps == at:
                engine.abort_request(rid)
    return done, peak


@pytest.mark.parametrize("fused", [True, False], ids=["cpu_ops", "pytorch"])
def test_long_generation_in_a_pool_smaller_than_its_context(mistral, fused: bool) -> None:  # noqa: ANN001
    """90 tokens (23 blocks, 9 windows) in a pool of 7 usable blocks: accepted, completed
    equal to transformers, never holding more than the window plus a step
    (ceil((W - 1 + 8) / 4) + 1 = 6 blocks). The PyTorch decode path gathers whole block
    tables: it reads the null block behind the window, and masks it."""
    folder, ref = mistral
    engine = _windowed_engine(folder, 8)
    assert engine.kv_cache.sliding_window == MISTRAL_WINDOW and engine.kv_cache.num_blocks == 7
    assert -(-90 // 4) > engine.kv_cache.num_blocks  # keeping every block, it could not run
    if not fused:
        engine.model.use_fused_cpu_ops(False)
        engine.runner.backend.fused_cpu_ops = False
    prompts = random_prompts(10, (30,))
    done, peak = _run_tracking_peak(engine, prompts, 60)
    assert peak <= 6
    assert_equals_reference([done["r0"]], prompts, ref, 60)
    assert_no_leaks(engine)


def test_more_long_sequences_fit_at_once(mistral) -> None:  # noqa: ANN001
    """Three 80-token sequences (20 blocks each) side by side in 19 usable blocks: no
    preemption, outputs equal transformers'; one aborted midway leaks nothing."""
    folder, ref = mistral
    engine = _windowed_engine(folder, 20, max_num_batched_tokens=24)
    prompts = random_prompts(11, (20, 33, 7))
    done, peak = _run_tracking_peak(engine, prompts, 60 - 13)
    assert engine.get_stats().num_preemptions == 0 and peak <= 19
    assert_equals_reference([done[f"r{i}"] for i in range(3)], prompts, ref, 47)
    assert_no_leaks(engine)
    done, _ = _run_tracking_peak(engine, prompts, 47, abort={"r1": 12})  # past its window
    assert "r1" not in done and engine.kv_cache.num_released_blocks("r1") == 0
    assert_equals_reference([done["r0"], done["r2"]], prompts[::2], ref, 47)
    assert_no_leaks(engine)


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft", "quantization": "int8", "num_speculative_tokens": 3, "adaptive": False},
], ids=["ngram", "separate-draft"])
def test_speculative_decoding_with_released_blocks(mistral, speculative: dict) -> None:  # noqa: ANN001
    """Drafts get slots past the final tokens and rejected ones roll back: blocks are released
    from final tokens only. A separate draft has a cache of its own, from the same budget (12
    blocks each), whose blocks behind the window go back too. Repetitive prompts so drafts
    are proposed and accepted."""
    folder, ref = mistral
    separate = speculative["method"] == "draft"
    engine = _windowed_engine(folder, 24 if separate else 12, speculative=speculative)
    assert engine.kv_cache.num_blocks == 11  # (the null block)
    prompts = [[5, 6, 7, 8] * 6, random_prompts(12, (26,))[0]]
    done, peak = _run_tracking_peak(engine, prompts, 40)
    assert engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_equals_reference([done["r0"], done["r1"]], prompts, ref, 40)
    assert_no_leaks(engine)


def test_mixed_windows_get_block_tables_of_their_own(qwen2) -> None:  # noqa: ANN001
    """Qwen2 with max_window_layers 1: the full layer 0 on one block table, the windowed
    layers 1 and 2 on one each, pages of one layer (kv_cache/layout.py). 90 tokens (23
    blocks) hold 23 full-layer pages and at most 6 per windowed table: 35 pages of the 39
    given, where one table of 3-layer blocks would have 13 blocks and refuse the request."""
    folder, ref = qwen2
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4)
    page_bytes = kv_cache_bytes_per_block(engine.model, 4, torch.float32, page_layers=1)
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4,
                       max_num_batched_tokens=8, kv_cache_memory=40 * page_bytes)
    layout = engine.cache_config.layout
    assert layout.table_windows == (None, QWEN2_WINDOW, QWEN2_WINDOW)
    assert layout.layer_tables == (0, 1, 2) and engine.kv_cache.num_blocks == 39
    assert engine.kv_cache.max_blocks_held(90, 8) == 23 + 2 * 6
    prompts = random_prompts(15, (30,))
    done, peak = _run_tracking_peak(engine, prompts, 60)
    assert peak <= 35
    assert_equals_reference([done["r0"]], prompts, ref, 60)
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def qwen2_64(tmp_path_factory):  # noqa: ANN001, ANN201
    """The Qwen2 model with head_dim 64 (the C++ decode layers' size)."""
    return windowed_dir(tmp_path_factory.mktemp("models"), "qwen2", QWEN2_WINDOW, head_dim=64,
                        init_std=0.15)


def test_cpu_decode_layers_read_each_layers_table(qwen2_64, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """bfloat16 decode steps through cpu_ops.decode_layer on the hybrid layout: each layer
    reads its own block table (the full layer 0 its own, layers 1-2 theirs), the same bits
    as the module path, past the window."""
    llm = _cpp_layers_equal_module_path(qwen2_64, random_prompts(16, (6, 25, 40)), monkeypatch)
    assert llm.engine.cache_config.layout.num_tables == 3


def test_tensor_parallel_ranks_get_the_null_block_entries(mistral) -> None:  # noqa: ANN001
    """Two ranks (one KV head each): the block tables rank 0 sends carry the null block
    behind the window; every rank's cache has it zeroed. Same small pool as above."""
    folder, ref = mistral
    # Per token and rank: 2 layers x (K, V) x 1 kv head x 16 dims x 4 bytes = 256 bytes.
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4, tensor_parallel_size=2,
                       max_num_batched_tokens=8, kv_cache_memory=8 * 4 * 256)
    try:
        assert engine.kv_cache.num_blocks == 7
        prompts = random_prompts(13, (30,))
        done, peak = _run_tracking_peak(engine, prompts, 50)
        assert peak <= 6
        assert_equals_reference([done["r0"]], prompts, ref, 50)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
