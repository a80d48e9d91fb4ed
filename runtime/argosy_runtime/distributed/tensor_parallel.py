"""Tensor parallelism: one model split over several devices (or CPU processes), Megatron style.

Each rank holds 1/N of every decoder layer: its share of the attention heads (query and
key/value heads alike, so its KV cache holds only those heads) and of the MLP's intermediate
columns (every expert's, in an MoE layer). With fewer KV heads than ranks (Qwen2.5-1.5B's 2
over 4 GPUs), each rank holds the one KV head its query heads read: each KV head is
replicated on N / num_key_value_heads ranks (as vLLM does), and the KV cache with it.

The projections into a layer's heads and columns (q/k/v, gate/up) are split by output rows
and need no communication; the projections out of them (o_proj, down_proj) are split by input
columns, so each rank's output is a partial sum and one all-reduce per attention block and
per MLP block adds them up. Embeddings, norms, the router and the LM head are replicated:
every rank ends each layer with the same hidden state, and only rank 0 computes logits and
samples.

A rank's model is an ordinary model of the shard's shape (`shard_spec`) that reduces after
those two blocks (`LlamaForCausalLM.use_tensor_parallel`); its weights are the checkpoint's,
sliced as they stream in (`ShardedCheckpoint`).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from argosy_runtime.model_loader import ModelSpec

# HF weight names by the projection they end in: split by output rows (column parallel) or by
# input columns (row parallel). Mixtral's experts call gate/up/down w1/w3/w2.
_SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_SPLIT_COLUMNS = ("o_proj", "down_proj", "w2")


def check_tensor_parallel(spec: ModelSpec, world_size: int) -> None:
    """ValueError unless `spec` splits evenly over `world_size` ranks."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    sizes = {"num_attention_heads": spec.num_attention_heads,
             "num_key_value_heads": spec.num_key_value_heads,
             "intermediate_size": spec.intermediate_size}
    if _replicates_kv_heads(spec.num_key_value_heads, world_size):
        del sizes["num_key_value_heads"]
    if spec.is_moe:
        sizes["moe_intermediate_size"] = spec.moe_intermediate_size
        if spec.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    uneven = [f"{name} {value}" for name, value in sizes.items() if value % world_size]
    if uneven:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide this {spec.architecture} model: "
            f"{', '.join(uneven)} (each rank takes an equal share of the heads and MLP columns; "
            "pick a size that divides them; the KV heads may also be fewer than the ranks if "
            "their count divides it)")


def _replicates_kv_heads(num_kv_heads: int, world_size: int) -> bool:
    """Fewer KV heads than ranks, each on world_size / num_kv_heads of them."""
    return num_kv_heads < world_size and world_size % num_kv_heads == 0


def shard_spec(spec: ModelSpec, world_size: int) -> ModelSpec:
    """The shape of one rank's model: 1/world_size of the heads and MLP columns."""
    check_tensor_parallel(spec, world_size)
    return dataclasses.replace(
        spec,
        num_attention_heads=spec.num_attention_heads // world_size,
        num_key_value_heads=max(1, spec.num_key_value_heads // world_size),
        intermediate_size=spec.intermediate_size // world_size,
        moe_intermediate_size=spec.moe_intermediate_size // world_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // world_size,
    )


def shard_tensor(hf_name: str, tensor: torch.Tensor, rank: int, world_size: int,
                 num_kv_heads: int | None = None) -> torch.Tensor:
    """Rank `rank`'s slice of the checkpoint tensor `hf_name` (the whole tensor if replicated).
    `num_kv_heads`: the model's, needed only when it is below `world_size`."""
    parts = hf_name.split(".")
    if len(parts) < 2:
        return tensor
    projection = parts[-2]
    if (projection in ("k_proj", "v_proj") and num_kv_heads is not None
            and _replicates_kv_heads(num_kv_heads, world_size)):
        # Rank r's query heads are heads r * H/N .. (r + 1) * H/N - 1, all in KV group
        # r // (N / num_kv_heads) (a group is H / num_kv_heads query heads, a multiple of H/N).
        return tensor.chunk(num_kv_heads, dim=0)[rank // (world_size // num_kv_heads)]
    if projection in _SPLIT_ROWS:  # weight [out, in] or bias [out]
        return tensor.chunk(world_size, dim=0)[rank]
    if projection in _SPLIT_COLUMNS:
        if parts[-1] != "weight":  # never in the supported architectures (o/down have no bias)
            raise ValueError(f"tensor parallelism cannot split {hf_name}: a bias after a "
                             "row-parallel projection")
        return tensor.chunk(world_size, dim=1)[rank]
    return tensor


class ShardedCheckpoint:
    """A checkpoint as one rank loads it: the shard's spec, and each weight sliced to the
    rank's share as it is read. Everything else (tokenizer, path, format) is the checkpoint's."""

    def __init__(self, checkpoint: Any, rank: int, world_size: int) -> None:
        self._checkpoint = checkpoint
        self.rank = rank
        self.world_size = world_size
        self.spec = shard_spec(checkpoint.spec, world_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._checkpoint, name)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in self._checkpoint.iter_weights():
            # contiguous: a column slice is a strided view, and the loaders copy or quantize it
            yield hf_name, shard_tensor(hf_name, tensor, self.rank, self.world_size,
                                        self._checkpoint.spec.num_key_value_heads).contiguous()


class CollectiveError(RuntimeError):
    """An all-reduce failed: another rank failed or exited (gloo: "Connection closed by
    peer"). On rank 0 the message says which worker and why, when it is known."""


class TensorParallelGroup:
    """The collective side of tensor parallelism for one rank: the process group its
    all-reduces run on (gloo on CPUs, NCCL on CUDA devices)."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, device: torch.device,
                 timeout_s: float = 600.0, store: dist.Store | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self._store = store  # held: the group's connections were set up through it
        # Rank 0's: why the other ranks failed (TensorParallelWorkers.failure), asked when a
        # collective fails, since gloo says only that a peer closed its connection.
        self.explain_failure: Callable[[], str | None] | None = None
        # All-reduces this rank has started. A worker also publishes it to rank 0 in
        # `progress` (shared memory, [reduces started, steps done]): rank 0 compares it with
        # its own count to tell whether the ranks are still in step (TensorParallelWorkers).
        self.num_all_reduces = 0
        self.progress: Any = None
        prefixed = dist.PrefixStore("argosy-tp", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    @classmethod
    def listen(cls, world_size: int, timeout_s: float = 600.0) -> tuple[dist.TCPStore, int]:
        """Rank 0's rendezvous store on a free local port (the workers connect to it)."""
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return store, store.port

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self.num_all_reduces += 1
        if self.progress is not None:
            self.progress[0] = self.num_all_reduces
        try:
            self._group.allreduce([x]).wait()
        except RuntimeError as exc:
            why = self.explain_failure() if self.explain_failure is not None else None
            raise CollectiveError(why or str(exc)) from exc
        return x


def check_tensor_parallel_options(args: Any, device: torch.device, checkpoint: Any,
                                  quant_config: Any) -> None:
    """ValueError naming what tensor parallelism cannot run with (before any model loads)."""
    size = args.tensor_parallel_size
    check_tensor_parallel(checkpoint.spec, size)
    problems = []
    if device.type == "cuda" and size > torch.cuda.device_count():
        problems.append(f"it needs {size} CUDA devices; {torch.cuda.device_count()} are visible")
    if args.lora_modules or args.lora_modules_file:
        problems.append("LoRA adapters (their weights are not split over the ranks)")
    if args.batch_invariant:
        problems.append("batch_invariant (the all-reduce sums partials in another order)")
    if quant_config is not None and quant_config.source in ("gptq", "awq"):
        problems.append(f"a pre-quantized {quant_config.source.upper()} checkpoint (its packed "
                        "weights are not split); load the float checkpoint with "
                        "quantization='int4' instead")
    elif quant_config is not None and quant_config.algorithm == "gptq":
        problems.append("GPTQ calibration at load (use round-to-nearest int8 / int4)")
    elif quant_config is not None and checkpoint.format == "gguf":
        problems.append("quantizing a GGUF file (load it unquantized, or an HF folder)")
    if args.speculative is not None:
        from argosy_runtime.spec_decode.config import SpeculativeConfig

        speculative = SpeculativeConfig.from_user(args.speculative)
        if (speculative.method == "draft" and speculative.model is None
                and speculative.quantization is None):
            problems.append("the self-draft speculative method (the target's early layers); "
                            "use ngram or a draft model")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} cannot run with " + "; ".join(problems))
