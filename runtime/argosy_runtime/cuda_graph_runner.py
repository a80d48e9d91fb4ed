"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel-launch overhead (hundreds of launches
of a few microseconds of work each). Capturing the whole forward once per batch-size bucket and
replaying it removes that overhead. Shapes are fixed per graph, so:
- a pure-decode batch of n sequences runs in the smallest bucket >= n; rows n..bucket-1 are
  padding: token 0 at position 0, cache slot -1 (nothing written), context length 0
  (attention yields zeros), so they touch no real sequence;
- block tables are copied into a static [max_batch, max_blocks_per_seq] table (one per block
  table of a hybrid KV layout, kv_cache/layout.py, with its own slots); the decode kernel
  sizes its context splits from that width, never from device values;
- anything else (prefill chunks, speculative verification, batches above the largest
  bucket, block tables wider than the capture) runs eagerly.
The attention backend must be graph-safe (no host reads of device values):
`TritonAttentionBackend` is; the torch reference backend is not.

Usage (in the model runner, on CUDA):
    runner = CUDAGraphRunner(model, kv_caches, kv_scales, TritonAttentionBackend(...),
                             max_blocks_per_seq=..., device=device)
    runner.capture()                      # once, after the KV cache is allocated
    hidden = runner.forward(input_ids, positions, meta)   # replaces model(..., ctx)
The returned hidden states of a replay live in the graph's static output: consume them (e.g.
compute logits) before the next step.
"""

from __future__ import annotations

from typing import Any

import torch

from argosy_runtime.attention.metadata import AttentionMetadata
from argosy_runtime.models.llama import ForwardContext

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class CUDAGraphRunner:
    """Runs pure-decode steps of `model` from captured CUDA graphs, one per batch bucket.

    With `enable_graphs=False` (or off CUDA) it still pads into its static buffers and runs the
    same forward eagerly: the padding logic is testable on the CPU.
    """

    def __init__(
        self,
        model: Any,  # LlamaForCausalLM: forward(input_ids, positions, ctx), .rotary
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
        backend: Any,  # graph-safe attention backend (TritonAttentionBackend)
        *,
        max_blocks_per_seq: int,
        device: torch.device,
        max_batch_size: int = 256,
        buckets: tuple[int, ...] | None = None,
        enable_graphs: bool | None = None,
        num_tables: int = 1,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        chosen = sorted({b for b in (buckets or DEFAULT_BUCKETS) if 0 < b <= max_batch_size})
        if not chosen or chosen[-1] < max_batch_size:
            chosen.append(max_batch_size)
        self.buckets = tuple(chosen)
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.backend = backend
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_graphs = (self.device.type == "cuda") if enable_graphs is None \
            else enable_graphs
        if self.enable_graphs and self.device.type != "cuda":
            raise ValueError("enable_graphs=True needs a CUDA device")
        n, dev = max_batch_size, self.device
        # Static inputs shared by all buckets (a bucket of size b uses the first b rows).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((num_tables, n), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(num_tables, n, max_blocks_per_seq, dtype=torch.int32,
                                        device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self.num_replays = 0
        self.num_eager = 0

    # ---- static inputs ------------------------------------------------------------------
    def _meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata.of_tables([AttentionMetadata(
            slot_mapping=self.slot_mapping[t, :bucket],
            num_decodes=bucket,
            decode_block_tables=self.block_tables[t, :bucket],
            decode_context_lens=self.context_lens[:bucket],
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=self.block_tables[t, :0],
        ) for t in range(len(self.block_tables))])

    def _ctx(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(self.model.rotary, self.backend, self.kv_caches, meta,
                              self.kv_scales)

    def _forward_static(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket],
                          self._ctx(self._meta(bucket)))

    def bucket_for(self, num_seqs: int) -> int | None:
        """Smallest bucket holding num_seqs sequences, or None."""
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A pure-decode batch that fits a bucket and the captured block-table width."""
        return (
            meta.num_prefills == 0
            and meta.num_decodes == num_tokens
            and 0 < num_tokens <= self.max_batch_size
            and meta.decode_block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              bucket: int) -> None:
        n = input_ids.shape[0]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        for t in range(len(self.block_tables)):
            table_meta = meta.for_table(t)
            self.slot_mapping[t, :n].copy_(table_meta.slot_mapping, non_blocking=True)
            self.block_tables[t, :n, :width].copy_(table_meta.decode_block_tables,
                                                   non_blocking=True)
        if n < bucket:  # padding rows: write nothing, attend to nothing
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[:, n:bucket].fill_(-1)
            self.context_lens[n:bucket].zero_()

    # ---- capture / run ------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket (largest first, sharing one memory pool).

        Each bucket runs twice eagerly first: Triton compiles its kernels and quantized layers
        repack their weights outside the capture.
        """
        if not self.enable_graphs:
            return
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self._pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            for _ in range(2):
                self._forward_static(bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward_static(bucket)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a pure-decode batch (see `can_run`)."""
        n = input_ids.shape[0]
        if not self.can_run(n, meta):
            raise ValueError("run() takes pure-decode batches within the captured limits; "
                             "use forward() to fall back to eager")
        bucket = self.bucket_for(n)
        assert bucket is not None  # guaranteed by can_run
        self._load(input_ids, positions, meta, bucket)
        entry = self._graphs.get(bucket)
        if entry is None:  # graphs disabled (or not captured): same padded forward, eagerly
            return self._forward_static(bucket)[:n]
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out[:n]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Replay when the batch fits a captured graph, else run the model eagerly."""
        if self._graphs and self.can_run(input_ids.shape[0], meta):
            return self.run(input_ids, positions, meta)
        self.num_eager += 1
        return self.model(input_ids, positions, self._ctx(meta))


__all__ = ["CUDAGraphRunner", "DEFAULT_BUCKETS"]
