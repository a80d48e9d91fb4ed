"""LoRA adapters: many fine-tunes of one base model served from one set of weights.

`LoRAAdapter.load` reads a PEFT adapter folder; the engine keeps the adapters it serves by
name, and each step's `LoRABatch` adds every row's low-rank delta (x A^T B^T * scale) to the
base projections' outputs, one small matmul pair per adapter present in the batch.
"""

from argosy_runtime.lora.adapter import LoRAAdapter
from argosy_runtime.lora.batch import LoRABatch

__all__ = ["LoRAAdapter", "LoRABatch"]
