"""LoRA adapters: many fine-tunes of one base model served from one set of weights.

`LoRAAdapter.load` reads a PEFT adapter folder; the engine keeps the adapters it serves by
name, and each step's `LoRABatch` adds every row's low-rank delta (x A^T B^T * scale) to the
base projections' outputs, one small matmul pair per adapter present in the batch.
`LoRAModulesFile` keeps the served adapters in step with a file while the server runs.
"""

from argosy_runtime.lora.adapter import LoRAAdapter
from argosy_runtime.lora.batch import LoRABatch
from argosy_runtime.lora.modules_file import LoRAModulesFile

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAModulesFile"]
