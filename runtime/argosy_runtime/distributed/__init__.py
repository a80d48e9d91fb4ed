"""Running one model over several devices or processes (tensor parallelism)."""

from argosy_runtime.distributed.tensor_parallel import (
    ShardedCheckpoint,
    TensorParallelGroup,
    check_tensor_parallel,
    check_tensor_parallel_options,
    shard_spec,
    shard_tensor,
)
from argosy_runtime.distributed.workers import TensorParallelWorkers, WorkerConfig, kv_cache_budget

__all__ = [
    "ShardedCheckpoint",
    "TensorParallelGroup",
    "TensorParallelWorkers",
    "WorkerConfig",
    "check_tensor_parallel",
    "check_tensor_parallel_options",
    "kv_cache_budget",
    "shard_spec",
    "shard_tensor",
]
