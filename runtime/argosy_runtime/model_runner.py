"""Runs one step: flattens every scheduled token into one batch, runs the model, samples.

Owns the model, the paged KV cache tensors and the attention backend. Sequences with a single
query token (decodes) go first in the batch so attention handles them with one batched
paged-decode call; multi-token sequences (prompt chunks, speculative verification) follow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from argosy_kernels.reshape_and_cache import KV_SCALE_DTYPE

from argosy_runtime.attention import TorchAttentionBackend
from argosy_runtime.attention.batch import build_batch, decode_rows_first
from argosy_runtime.config import CacheConfig
from argosy_runtime.kv_cache import HybridKVCacheManager, KVCacheManager, single_table_layout
from argosy_runtime.lora import LoRAAdapter, LoRABatch
from argosy_runtime.model_loader import ModelSpec
from argosy_runtime.models.llama import ForwardContext, LlamaForCausalLM
from argosy_runtime.outputs import PositionLogprobs
from argosy_runtime.pooler import pool_outputs
from argosy_runtime.sampler import Sampler, compute_logprobs
from argosy_runtime.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("argosy.engine")


@dataclass
class ModelRunnerOutput:
    # request_id -> sampled token ids this step (empty for a prompt chunk that did not finish)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> logprobs of each sampled token
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request_id -> prompt logprobs computed this step (for prompt tokens, in order)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request_id -> float32 logits [num_spec + 1, vocab] for speculative verification
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # request_id -> the output of a pooling request whose prompt ended this step: its
    # embedding, or (task "classify") its classification head's logits
    pooled: dict[str, list[float]] = field(default_factory=dict)


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, cache_dtype: torch.dtype,
                             page_layers: int | None = None) -> int:
    """Bytes one cache block (page) takes over `page_layers` layers (default: all of them,
    kv_cache/layout.py): K and V, plus an int8 cache's scales (one KV_SCALE_DTYPE per token
    per kv head, for K and for V)."""
    s = model.spec
    layers = s.num_hidden_layers if page_layers is None else page_layers
    per_token = 2 * layers * s.num_key_value_heads * s.head_dim
    elem = torch.tensor([], dtype=cache_dtype).element_size()
    scales = 0
    if cache_dtype == torch.int8:
        scale_elem = torch.tensor([], dtype=KV_SCALE_DTYPE).element_size()
        scales = 2 * layers * s.num_key_value_heads * scale_elem
    return block_size * (per_token * elem + scales)


def use_cuda_graphs(device: torch.device, enabled: bool, spec: ModelSpec,
                   tensor_parallel: bool = False) -> bool:
    """Whether decode steps replay captured CUDA graphs: on CUDA unless turned off
    (`enforce_eager`), and never for a Mixture-of-Experts model, whose blocks group tokens by
    expert from routing read on the host (models/moe.py), which a graph replay cannot redo,
    nor for a tensor-parallel one (its all-reduces are not captured)."""
    if device.type != "cuda" or not enabled or spec.is_encoder:  # encoders never decode
        return False
    if tensor_parallel:
        logger.info("CUDA graphs off: tensor-parallel decode steps run eagerly")
        return False
    if spec.is_moe:
        logger.info("CUDA graphs off: %s is a Mixture-of-Experts model (expert routing is read "
                    "on the host); decode steps run eagerly", spec.architecture)
        return False
    return True


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig,
                 kv_cache: KVCacheManager | HybridKVCacheManager | None,
                 device: torch.device, vocab_size: int, seed: int = 0,
                 max_model_len: int = 0, enable_cuda_graphs: bool = False,
                 batch_invariant: bool = False, tensor_parallel_workers: Any = None) -> None:
        """`kv_cache` None: a tensor-parallel worker's runner, which only runs `forward` on the
        batches rank 0 sends. `tensor_parallel_workers` (rank 0 of a tensor-parallel engine):
        the other ranks, sent every step's batch before this rank runs it."""
        self.model = model
        self.tensor_parallel_workers = tensor_parallel_workers
        self.spec = model.spec
        self.cache_config = cache_config
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = cache_config.block_size
        s = self.spec
        backend_cls = TorchAttentionBackend
        if device.type == "cuda":  # Triton kernels on GPUs; the torch reference on CPUs
            from argosy_runtime.attention.triton_backend import TritonAttentionBackend

            backend_cls = TritonAttentionBackend
        self.batch_invariant = batch_invariant
        kwargs = {"batch_invariant": True} if batch_invariant else {}
        self.backend = backend_cls(
            s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.attention_scale, **kwargs
        )
        # An encoder (models/bert.py) attends within the step only: its blocks are bookkeeping.
        num_cache_blocks = cache_config.num_blocks if getattr(model, "uses_kv_cache", True) else 0
        # Pages of `page_layers` layers; each layer reads its slot through its block table.
        layout = cache_config.layout or single_table_layout(s.num_hidden_layers)
        model.kv_layer_tables = layout.layer_tables if layout.is_hybrid else None
        shape = (layout.page_layers, 2, num_cache_blocks, self.block_size,
                 s.num_key_value_heads, s.head_dim)
        # Zero-filled: padded positions are masked, but 0 * NaN garbage would still be NaN.
        self.kv = torch.zeros(shape, dtype=cache_config.cache_dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in layout.layer_slots]
        self.kv_scales = None
        if cache_config.cache_dtype == torch.int8:
            self.scales = torch.ones(shape[:-1], dtype=KV_SCALE_DTYPE, device=device)
            self.kv_scales = [(self.scales[i, 0], self.scales[i, 1]) for i in layout.layer_slots]
        self.graph_runner = None
        if use_cuda_graphs(device, enable_cuda_graphs, s, model.tensor_parallel is not None):
            from argosy_runtime.cuda_graph_runner import CUDAGraphRunner

            self.graph_runner = CUDAGraphRunner(
                model, self.kv_caches, self.kv_scales, self.backend,
                max_blocks_per_seq=-(-max_model_len // self.block_size), device=device,
                num_tables=layout.num_tables,
            )
            self.graph_runner.capture()
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.sampler = Sampler(vocab_size, generator)

    # ---- inputs -------------------------------------------------------------------------
    def _batch_entries(self, scheduled: list[ScheduledRequest]) -> list:
        """(KV block ids, first position, token ids) of each scheduled sequence: all a rank
        needs to run the step (build_batch)."""
        entries = []
        for sr in scheduled:
            req = sr.request
            start = req.num_computed_tokens
            tokens = req.token_ids[start : start + sr.num_new_tokens - sr.num_spec_tokens]
            tokens = tokens + req.spec_token_ids[: sr.num_spec_tokens]
            # [blocks], or [tables, blocks] for a hybrid layout (kv_cache/layout.py)
            block_ids = np.asarray(self.kv_cache.block_ids(req.request_id), dtype=np.int64)
            entries.append((block_ids, start, tokens))
        return entries

    def _lora_batch(self, scheduled: list[ScheduledRequest]) -> LoRABatch | None:
        """The batch rows of each LoRA adapter's requests (rows follow `scheduled`).

        Grouped by adapter object, not name: a name loaded again while its old requests still
        run has two adapters in the step, each with its own weights."""
        groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        offset = 0
        for sr in scheduled:
            adapter = sr.request.lora
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].extend(
                    range(offset, offset + sr.num_new_tokens))
            offset += sr.num_new_tokens
        if not groups:
            return None
        return LoRABatch([(adapter, torch.tensor(rows, dtype=torch.long, device=self.device))
                          for adapter, rows in groups.values()], self.batch_invariant)

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, entries: list, lora: LoRABatch | None = None,
                token_type_starts: list[int | None] | None = None) -> torch.Tensor:
        """The model's hidden states [tokens, hidden] for one step's batch (`_batch_entries`,
        decode rows first), its new K/V written into the cache. `token_type_starts` (an
        encoder's step): per entry, where token type 1 starts (None: all 0)."""
        input_ids, positions, meta = build_batch(entries, self.block_size, self.device,
                                                 self.model.decode_rows_up_to)
        if self.graph_runner is not None and lora is None:  # replays captured decode graphs
            return self.graph_runner.forward(input_ids, positions, meta)
        ctx = ForwardContext(self.model.rotary, self.backend, self.kv_caches, meta, self.kv_scales)
        ctx.lora = lora
        ctx.token_type_starts = token_type_starts
        return self.model(input_ids, positions, ctx)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Decode rows first (keeps the scheduler's order within each group).
        order = decode_rows_first([sr.num_new_tokens for sr in sched.scheduled],
                                  self.model.decode_rows_up_to)
        scheduled = [sched.scheduled[i] for i in order]
        entries = self._batch_entries(scheduled)
        if self.tensor_parallel_workers is not None:
            self.tensor_parallel_workers.run_step(entries)
        types = None
        if self.spec.is_encoder:  # token types travel with the request, not in its ids
            types = [sr.request.pooling.token_type_start if sr.request.pooling else None
                     for sr in scheduled]
        try:
            hidden = self.forward(entries, self._lora_batch(scheduled), types)
        except BaseException as exc:
            if self.tensor_parallel_workers is not None:
                # Stopped between two all-reduces (out of memory, a kernel's error), the
                # workers wait in the next one: rank 0's next step would meet them there,
                # summing another layer's partial sums. On CUDA the workers' all-reduces do
                # not block them, so their progress alone (run_step's check) cannot tell.
                self.tensor_parallel_workers.abandon(f"rank 0's step failed in its forward: "
                                                     f"{exc!r}")
            raise

        out = ModelRunnerOutput()
        head = self.model.compute_class_logits if self.model.score is not None else None
        out.pooled = pool_outputs(scheduled, hidden, head)
        # Which rows need logits: the last row of each sequence that samples, every draft row
        # plus the bonus row of speculative sequences, and prompt rows for prompt_logprobs.
        # Embedding requests need none.
        rows: list[int] = []
        sample_rows: list[tuple[ScheduledRequest, int]] = []
        spec_rows: list[tuple[ScheduledRequest, int, int]] = []
        prompt_rows: list[tuple[ScheduledRequest, int, int, int]] = []
        offset = 0
        for sr in scheduled:
            req = sr.request
            n = sr.num_new_tokens
            if req.pooling is not None:
                offset += n
                continue
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
                # Position p predicts prompt token p + 1; the first row of this chunk is at
                # position num_computed_tokens.
                first = req.num_computed_tokens
                last = min(first + n, req.num_prompt_tokens - 1)
                first = max(first, len(req.prompt_logprobs) - 1)
                if last > first:
                    prompt_rows.append((sr, len(rows), last - first, first + 1))
                    rows.extend(range(offset + first - req.num_computed_tokens,
                                      offset + last - req.num_computed_tokens))
            if sr.num_spec_tokens:
                spec_rows.append((sr, len(rows), sr.num_spec_tokens + 1))
                rows.extend(range(offset + n - sr.num_spec_tokens - 1, offset + n))
            elif sr.completes_sequence and req.max_tokens:  # max_tokens 0: prompt only
                sample_rows.append((sr, len(rows)))
                rows.append(offset + n - 1)
            offset += n
        if not rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        logits = logits.cpu()
        if sample_rows:
            reqs = [sr.request for sr, _ in sample_rows]
            sample_logits = logits[[r for _, r in sample_rows]]
            tokens = self.sampler(sample_logits, reqs)
            for i, (sr, _) in enumerate(sample_rows):
                req = sr.request
                out.sampled[req.request_id] = [tokens[i]]
                if req.logprobs is not None:
                    out.logprobs[req.request_id] = compute_logprobs(
                        sample_logits[i : i + 1, : self.sampler.vocab_size], [tokens[i]],
                        req.params.logprobs or 0,
                    )
        for sr, start, count in spec_rows:
            out.spec_logits[sr.request.request_id] = logits[start : start + count]
        for sr, start, count, first_target in prompt_rows:
            req = sr.request
            out.prompt_logprobs[req.request_id] = compute_logprobs(
                logits[start : start + count, : self.sampler.vocab_size],
                req.token_ids[first_target : first_target + count],
                req.params.prompt_logprobs or 0,
            )
        return out

