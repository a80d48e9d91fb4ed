"""Gemma 3 text models equal transformers' Gemma3ForCausalLM / Gemma3ForConditionalGeneration.

A tiny random Gemma 3 with every way it differs from Llama switched on: four norms per layer
scaling by 1 + weight, per-head q/k norms, gelu-tanh MLP, embeddings times sqrt(hidden),
head_dim 32 apart from hidden / heads, attention scale query_pre_attn_scalar ** -0.5 (not
head_dim's), sliding-window layers (window 8, block_size 4) beside full ones, the sliding
layers' own rotary base, linear rope scaling on the full layers. Greedy tokens and logprobs
equal transformers' in float32 past the window, through chunked prefill, prefix-cache hits,
preemption, n-gram speculative decoding and a LoRA adapter (PEFT's); bfloat16 (fused C++ norms and rotary; never the C++ decode layer, which knows
Llama's layer only) and int8 weights stay close; a Gemma3ForConditionalGeneration folder
serves its text model, final logit soft-capping included; a llama.cpp gemma3 GGUF file (norms
stored plus 1) equals its folder."""

from __future__ import annotations

import logging

import pytest
import torch
from argosy_runtime import LLM, LLMEngine
from argosy_runtime.model_loader.gguf_metadata import open_gguf
from argosy_runtime.models.cpu_decode import CpuDecodeLayers
from engine_helpers import (
    FullForwardReference,
    assert_equals_reference,
    assert_no_leaks,
    check_window_prefix_hits_and_preemption,
    greedy,
    random_prompts,
    run_requests,
    tokens_and_logprobs,
)
from model_factory import (
    embedded_tokenizer_files,
    make_peft_adapter,
    make_random_model_dir,
    write_gguf_from_hf_dir,
)

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
GEMMA3_CONFIG = dict(
    sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)
MAX_POSITIONS = 256


def gemma3_dir(tmp_path, **extra):  # noqa: ANN001, ANN201
    """The test model (`extra`: more config fields). init_std 0.15: with the default 0.5 the
    embeddings, times sqrt(hidden), outweigh the layers and greedy decoding repeats the
    previous token."""
    return make_random_model_dir(
        tmp_path, "gemma3", name=f"gemma3-{len(extra)}", num_hidden_layers=4, head_dim=32,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, rms_norm_eps=1e-6,
        init_std=0.15, extra_config={**GEMMA3_CONFIG, **extra})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = gemma3_dir(tmp_path_factory.mktemp("models"))
    return folder, FullForwardReference.from_folder(folder)


def test_past_the_window_equals_transformers(gemma3) -> None:  # noqa: ANN001
    """Prompts shorter than, equal to and several times the window, in prefill chunks of 16
    (a chunk after cached tokens crosses the window), 20 generated tokens each."""
    folder, ref = gemma3
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "gemma3" and spec.layer_sliding_windows == (8, None, 8, 8)
    assert (spec.local_rope_theta, spec.rope_theta) == (100.0, 5000.0)
    assert spec.attention_scale == 24 ** -0.5 and llm.engine.runner.backend.scale == 24 ** -0.5
    prompts = random_prompts(1, (1, WINDOW - 1, WINDOW, WINDOW + 1, 23, 40))
    outputs = llm.generate(prompts, greedy(20))
    assert_equals_reference(outputs, prompts, ref, 20)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 20  # not degenerate
    assert_no_leaks(llm.engine)


def test_prefix_hits_and_preemption(gemma3) -> None:  # noqa: ANN001
    """A shared prefix longer than the window (cache hits start a chunk mid-window) and a KV
    pool too small for all requests (preempted ones recompute)."""
    folder, ref = gemma3
    # Pages of one layer (one full table, three windowed; kv_cache/layout.py), per token:
    # (K, V) x 2 kv heads x 32 dims x 4 bytes = 512 bytes. 40 pages (39 and the null page).
    check_window_prefix_hits_and_preemption(folder, ref, 512, 40, 18, (3, 9, 1, 12), 16)


def test_ngram_speculative_decoding_equals_transformers(gemma3) -> None:  # noqa: ANN001
    """Speculative verification (chunks of 1 + k tokens through both rotary tables and the
    windows) changes nothing: prompts that repeat themselves so drafts get accepted."""
    folder, ref = gemma3
    llm = LLM(model=str(folder), dtype="float32", block_size=4, speculative="ngram")
    base = random_prompts(10, (6, 5))
    prompts = [p * 4 for p in base]
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0
    assert_no_leaks(llm.engine)


def test_lora_adapter_equals_peft(gemma3, tmp_path) -> None:  # noqa: ANN001
    """A PEFT adapter on every projection (q/k/v/o/gate/up/down, Gemma's names are Llama's)
    beside the base model in one batch, each equal to transformers + PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, ref = gemma3
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    make_peft_adapter(folder, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=targets)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
        str(tmp_path / "a")).eval()
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4,
                       max_num_batched_tokens=16, lora_modules={"a": str(tmp_path / "a")})
    prompt = random_prompts(11, (13,))[0]
    on_adapter, on_base = run_requests(engine, [(prompt, greedy(10))] * 2, ["a", None])
    with_adapter = FullForwardReference(peft).greedy(prompt, 10)[0]
    assert with_adapter != ref.greedy(prompt, 10)[0]  # the adapter matters
    assert on_adapter.outputs[0].token_ids == with_adapter
    assert on_base.outputs[0].token_ids == ref.greedy(prompt, 10)[0]
    assert_no_leaks(engine)


def assert_close(outputs, prompts, ref: FullForwardReference, n: int, tol: float,  # noqa: ANN001
                 max_flips: int = 1) -> None:
    """Until the first disagreement (contexts equal), logprobs within `tol`; at most
    `max_flips` prompts diverge (a near-tie flipped by rounding)."""
    agree = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = ref.greedy(prompt, n)
        seq = out.outputs[0]
        for pos, (got, want) in enumerate(zip(seq.token_ids, tokens)):
            total += 1
            agree += got == want
            assert abs(seq.logprobs[pos][got].logprob - logprobs[pos][got].item()) < tol
            if got != want:
                break
    assert agree >= total - max_flips


def test_bfloat16_stays_close_to_transformers_bfloat16(gemma3) -> None:  # noqa: ANN001
    """bf16: the fused C++ rotary and attention (when built here), the norms in float32 as
    Gemma's (never the C++ decode layer, which knows Llama's layer only). This tiny model
    amplifies bf16 rounding (transformers' own bf16 logprobs move up to ~0.75 from its float32
    ones), so the first generated position is compared with transformers in bfloat16."""
    from transformers import AutoModelForCausalLM

    folder, ref = gemma3
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    llm = LLM(model=str(folder), dtype="bfloat16", block_size=4, max_num_batched_tokens=16)
    model = llm.engine.model
    assert model.cpu_decode is None and CpuDecodeLayers.build(model.model) is None
    assert model.model.layers[0].self_attn.q_norm.ops == model.ops
    assert model.model.norm.weight.dtype == torch.float32  # 1 + w, unrounded
    prompts = random_prompts(5, (6, 30, 3, 12, 17, 40))
    agree = 0
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(1)), strict=True):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        token = out.outputs[0].token_ids[0]
        # Either transformers' bf16 or its float32 choice (near-ties flip either way).
        agree += token in (int(want.argmax()), ref.greedy(prompt, 1)[0][0])
        assert abs(out.outputs[0].logprobs[0][token].logprob - want[token].item()) < 0.3
    assert agree >= len(prompts) - 1
    assert_no_leaks(llm.engine)


def test_int8_weights_stay_close(gemma3) -> None:  # noqa: ANN001
    folder, ref = gemma3
    llm = LLM(model=str(folder), dtype="float32", quantization="int8", block_size=4)
    assert type(llm.engine.model.model.layers[0].self_attn.qkv_proj).__name__ == "Int8Linear"
    prompts = random_prompts(6, (5, 20, 9))
    assert_close(llm.generate(prompts, greedy(8)), prompts, ref, 8, tol=0.4, max_flips=3)


def test_pure_torch_ops_equal_transformers(gemma3) -> None:  # noqa: ANN001
    """Without the C++ attention kernels: decode rows through the gathered-block SDPA, one
    mask per window (full and windowed layers), prompt chunks through masked SDPA."""
    folder, ref = gemma3
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    llm.engine.model.use_fused_cpu_ops(False)
    llm.engine.runner.backend.fused_cpu_ops = False
    prompts = random_prompts(7, (3, 26))
    assert_equals_reference(llm.generate(prompts, greedy(16)), prompts, ref, 16)


def multimodal_dir(tmp_path, text_dir, original_format: bool = True):  # noqa: ANN001, ANN201
    """A Gemma3ForConditionalGeneration folder (tiny SigLIP tower and projector) whose text
    model has `text_dir`'s weights, saved as transformers 5 saves it by default (the Hub's
    names: language_model.model.*, vision_tower.*, multi_modal_projector.*) or, with
    `original_format` False, in its in-memory names (model.language_model.*,
    model.vision_tower.*, lm_head.* when untied)."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text = AutoModelForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision,
                          mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    folder = tmp_path / f"gemma3-multimodal-{original_format}"
    model.save_pretrained(folder, save_original_format=original_format)
    for name, content in embedded_tokenizer_files().items():
        (folder / name).write_bytes(content)
    return folder


@pytest.mark.parametrize("original_format", [True, False])
def test_conditional_generation_serves_its_text_model(tmp_path, caplog,  # noqa: ANN001
                                                      original_format: bool) -> None:
    """The text of a multimodal Gemma 3 folder equals transformers' text-only forward of
    Gemma3ForConditionalGeneration; its vision tower and projector are skipped."""
    from safetensors import safe_open
    from transformers import Gemma3ForConditionalGeneration

    folder = multimodal_dir(tmp_path, gemma3_dir(tmp_path), original_format)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    prefix = "" if original_format else "model."
    assert any(n.startswith(prefix + "vision_tower.") for n in names)
    text_prefix = "language_model.model." if original_format else "model.language_model."
    assert any(n.startswith(text_prefix + "layers.") for n in names)
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO, logger="argosy.model_loader"):
        llm = LLM(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert "text model only" in caplog.text
    prompts = random_prompts(8, (5, 21))
    assert_equals_reference(llm.generate(prompts, greedy(12)), prompts, FullForwardReference(hf), 12)


def test_final_logit_softcapping(tmp_path) -> None:  # noqa: ANN001
    """Gemma3ForCausalLM's logits -> cap * tanh(logits / cap); a cap small enough to change
    every logprob (all logits within (-3, 3))."""
    folder = gemma3_dir(tmp_path, final_logit_softcapping=3.0)
    ref = FullForwardReference.from_folder(folder)
    llm = LLM(model=str(folder), dtype="float32", block_size=4)
    assert llm.engine.spec.final_logit_softcapping == 3.0
    prompts = random_prompts(9, (4, 17))
    assert_equals_reference(llm.generate(prompts, greedy(8)), prompts, ref, 8)
    hidden = 100 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert llm.engine.model.compute_logits(hidden).abs().max() <= 3.0


def test_gguf_file_equals_transformers(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's gemma3 GGUF: norms stored as 1 + weight, post_attention_norm / ffn_norm /
    post_ffw_norm, the window and final soft-capping in metadata, linear scaling on the full
    layers. Its graph fixes what the file does not say (every 6th layer full, sliding rotary
    base 10000, query_pre_attn_scalar = head_dim), so the folder has those values."""

    folder = gemma3_dir(
        tmp_path, num_hidden_layers=6, query_pre_attn_scalar=32, final_logit_softcapping=10.0,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    gguf = write_gguf_from_hf_dir(folder, tmp_path / "gemma3.gguf")
    assert "blk.0.post_ffw_norm.weight" in [t.name for t in open_gguf(gguf).tensors]
    ref = FullForwardReference.from_folder(folder)
    llm = LLM(model=str(gguf), dtype="float32", block_size=4, max_num_batched_tokens=16)
    spec = llm.engine.spec
    assert spec.architecture == "gemma3" and spec.hidden_act == "gelu_pytorch_tanh"
    assert spec.layer_sliding_windows == (WINDOW,) * 5 + (None,)
    assert (spec.query_pre_attn_scalar, spec.local_rope_theta, spec.final_logit_softcapping,
            spec.rope_scaling) == (32.0, 10000.0, 10.0, {"rope_type": "linear", "factor": 8.0})
    prompts = random_prompts(10, (3, 21))
    assert_equals_reference(llm.generate(prompts, greedy(8)), prompts, ref, 8)
    assert_no_leaks(llm.engine)


def test_attention_logit_softcapping_is_refused(tmp_path) -> None:  # noqa: ANN001
    """transformers' Gemma 3 stores attn_logit_softcapping but never applies it (its Gemma 2
    does: tests/runtime/engine/test_gemma2.py): a Gemma 3 that sets it is ambiguous."""
    folder = gemma3_dir(tmp_path, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="Gemma 3 attention ignores it"):
        LLM(model=str(folder), dtype="float32")


# ---- the hybrid KV layout (kv_cache/layout.py): one full table, three windowed ones ---------
# Pages of one layer: per token, (K, V) x 2 kv heads x 32 dims x 4 bytes = 512 bytes.
PAGE_BYTES_PER_TOKEN = 512


def _hybrid_engine(folder, pages: int, **kwargs) -> LLMEngine:  # noqa: ANN001
    """float32, 4-token blocks, 8-token steps, `pages` one-layer pages of KV memory."""
    return LLMEngine(model=str(folder), dtype="float32", block_size=4, max_num_batched_tokens=8,
                     kv_cache_memory=pages * 4 * PAGE_BYTES_PER_TOKEN, **kwargs)


def test_hybrid_layout_fits_more_long_sequences(gemma3, monkeypatch) -> None:  # noqa: ANN001
    """Three 60-token sequences (15 blocks each) in the memory of 95 one-layer pages. On the
    hybrid layout each holds its 15 full-layer pages and at most 5 per windowed table (the
    window of 8 plus an 8-token step): 30, so all three run at once. On one table of
    four-layer blocks the same memory is 23 blocks: 15 each, so requests are preempted.
    Both equal transformers."""
    folder, ref = gemma3
    prompts = random_prompts(20, (20, 17, 23))
    new = [60 - len(p) for p in prompts]
    hybrid = _hybrid_engine(folder, 95)
    layout = hybrid.cache_config.layout
    assert (layout.num_tables, layout.page_layers, hybrid.kv_cache.num_blocks) == (4, 1, 94)
    assert hybrid.kv_cache.max_blocks_held(60, 8) == 15 + 3 * 5
    outputs = run_requests(hybrid, [(p, greedy(n)) for p, n in zip(prompts, new)])
    assert hybrid.get_stats().num_preemptions == 0
    for out, prompt, n in zip(outputs, prompts, new):
        assert_equals_reference([out], [prompt], ref, n)
    assert_no_leaks(hybrid)

    from argosy_runtime.kv_cache import single_table_layout

    monkeypatch.setattr("argosy_runtime.engine.kv_cache_layout",
                        lambda windows, num_layers, max_len: single_table_layout(num_layers))
    one_table = _hybrid_engine(folder, 95)
    assert one_table.kv_cache.num_blocks == 23
    outputs = run_requests(one_table, [(p, greedy(n)) for p, n in zip(prompts, new)])
    assert one_table.get_stats().num_preemptions > 0
    for out, prompt, n in zip(outputs, prompts, new):
        assert_equals_reference([out], [prompt], ref, n)


def test_int8_kv_cache_on_hybrid_tables(gemma3, monkeypatch) -> None:  # noqa: ANN001
    """The int8 cache's scales are laid out like the K/V (a slot per page layer, read through
    each layer's table): past the window, the same tokens and logprobs as an int8 cache on
    one table, and close to transformers (the int8 rounding moves this model's logprobs by
    up to ~0.15 either way)."""
    folder, ref = gemma3
    prompts = random_prompts(17, (5, 33))
    engine = _hybrid_engine(folder, 60, kv_cache_dtype="int8")
    assert tuple(engine.runner.scales.shape[:3]) == (1, 2, engine.cache_config.num_blocks)
    hybrid = [tokens_and_logprobs(o)
              for o in run_requests(engine, [(p, greedy(16)) for p in prompts])]
    assert_no_leaks(engine)
    from argosy_runtime.kv_cache import single_table_layout

    monkeypatch.setattr("argosy_runtime.engine.kv_cache_layout",
                        lambda windows, num_layers, max_len: single_table_layout(num_layers))
    one_table = _hybrid_engine(folder, 60, kv_cache_dtype="int8")
    outputs = run_requests(one_table, [(p, greedy(16)) for p in prompts])
    for (tokens, logprobs), out in zip(hybrid, outputs):
        assert out.outputs[0].token_ids == tokens
        assert max(abs(a - b) for a, b in zip(tokens_and_logprobs(out)[1], logprobs)) < 1e-5
    assert_close(outputs, prompts, ref, 16, tol=0.25)


@pytest.mark.parametrize("speculative", [
    {"method": "draft", "draft_layers": 2, "num_speculative_tokens": 3},
    {"method": "draft", "model": "the target's folder", "num_speculative_tokens": 3,
     "adaptive": False},
], ids=["self-draft", "separate-draft"])
def test_draft_models_on_hybrid_tables(gemma3, speculative: dict) -> None:  # noqa: ANN001
    """A self-draft runs the target's first layers (a windowed and the full one) on their
    own tables: drafts get slots in every table and rejected ones roll back in every table.
    A separate draft (a copy of the target) has a cache of its own in the same hybrid layout,
    a page per target page, within the same KV budget, and its windowed tables give back
    their pages too: every draft is accepted past the window. Small pool, long sequences,
    repetitive prompts so the self-draft's drafts are accepted."""
    folder, ref = gemma3
    if "model" in speculative:
        speculative = {**speculative, "model": str(folder)}
    engine = _hybrid_engine(folder, 140, speculative=speculative)
    layout = engine.cache_config.layout
    assert layout.is_hybrid
    if "draft_layers" in speculative:
        assert engine.kv_cache.num_blocks == 139  # and the null block
    else:  # the budget holds both caches: 70 one-layer pages each
        draft = engine.proposer.proposer.cache
        assert draft.layout == layout
        assert draft.manager.num_blocks == engine.kv_cache.num_blocks == 69
        assert draft.kv.nbytes == engine.runner.kv.nbytes == 70 * 4 * PAGE_BYTES_PER_TOKEN
        released = []  # after each step: r0's draft pages given back on a windowed table
        step = engine.step

        def step_and_look():  # noqa: ANN202
            outputs = step()
            released.append(draft.manager.tables[1].num_released_blocks("r0"))
            return outputs

        engine.step = step_and_look
    prompts = [[5, 6, 7, 8] * 6, random_prompts(12, (26,))[0]]
    outputs = run_requests(engine, [(p, greedy(30)) for p in prompts])
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if "model" in speculative:
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert max(released) >= 10  # of r0's 14 blocks (56 tokens), behind the window of 8
    assert_equals_reference(outputs, prompts, ref, 30)
    assert_no_leaks(engine)


def test_a_separate_draft_catches_up_a_long_prompt_in_chunks(gemma3) -> None:  # noqa: ANN001
    """A draft meets a 60-token prompt with 39 pages of its own (15 blocks in each of 4
    tables at once would be 60): it catches up 8 tokens at a time, its windowed tables
    giving back what falls behind between chunks, as the target's prefill does, so it
    drafts (every draft of a copy accepted) instead of leaving the request undrafted."""
    folder, ref = gemma3
    engine = _hybrid_engine(folder, 80, speculative={
        "method": "draft", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False})
    assert engine.proposer.proposer.cache.manager.num_blocks == 39
    prompts = random_prompts(19, (60,))
    outputs = run_requests(engine, [(prompts[0], greedy(20))])
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_equals_reference(outputs, prompts, ref, 20)
    assert_no_leaks(engine)


def test_tensor_parallel_ranks_share_the_hybrid_layout(gemma3) -> None:  # noqa: ANN001
    """Two ranks, one KV head each (256 bytes per token and page): rank 0 sends every
    table's block ids; each rank's cache has the same pages."""
    folder, ref = gemma3
    engine = LLMEngine(model=str(folder), dtype="float32", block_size=4, tensor_parallel_size=2,
                       max_num_batched_tokens=8, kv_cache_memory=40 * 4 * 256)
    try:
        assert engine.kv_cache.num_blocks == 39 and engine.cache_config.layout.num_tables == 4
        prompts = random_prompts(13, (30,))
        assert_equals_reference(run_requests(engine, [(prompts[0], greedy(30))]), prompts, ref, 30)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_decode_graph_buffers_carry_every_table(gemma3) -> None:  # noqa: ANN001
    """The CUDA graph runner's static inputs (here padded and run eagerly on the CPU, as a
    replay would read them): a block table and slot mapping per table. Decode steps of two
    sequences run through them, padded to a bucket of 4, and still equal transformers."""
    from argosy_runtime.cuda_graph_runner import CUDAGraphRunner

    folder, ref = gemma3
    engine = _hybrid_engine(folder, 95)
    runner = engine.runner
    runner.backend.fused_cpu_ops = False  # the C++ kernel refuses padding rows (length 0)
    graphs = CUDAGraphRunner(engine.model, runner.kv_caches, runner.kv_scales, runner.backend,
                             max_blocks_per_seq=32, device=engine.device, max_batch_size=4,
                             buckets=(4,), enable_graphs=False, num_tables=4)
    graphs._graphs = {0: None}  # noqa: SLF001 (truthy, no bucket 0: run() pads, runs eagerly)
    runs = []
    run = graphs.run
    graphs.run = lambda *args: runs.append(1) or run(*args)
    runner.graph_runner = graphs
    prompts = random_prompts(14, (9, 21))
    assert_equals_reference(run_requests(engine, [(p, greedy(20)) for p in prompts]),
                            prompts, ref, 20)
    assert len(runs) >= 15
    assert_no_leaks(engine)
