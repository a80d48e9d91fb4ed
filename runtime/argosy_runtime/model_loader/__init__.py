"""Model loading: resolve a model argument, read its spec, tokenizer and weights.

    ckpt = load_checkpoint("smollm2-135m")          # or a HF folder, or a .gguf file
    ckpt.spec.num_hidden_layers, ckpt.tokenizer.encode("hi")
    for name, tensor in ckpt.iter_weights(): ...     # HF parameter names

`Checkpoint` and `load_checkpoint` import torch, so they are loaded lazily: importing this
package (e.g. for `resolve_model_path` or the GGUF metadata helpers) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from argosy_runtime.model_loader.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec
from argosy_runtime.model_loader.resolve import MODEL_ALIASES, resolve_model_path

if TYPE_CHECKING:  # pragma: no cover
    from argosy_runtime.model_loader.checkpoint import Checkpoint
    from argosy_runtime.model_loader.load import load_checkpoint

__all__ = [
    "Checkpoint",
    "MODEL_ALIASES",
    "ModelSpec",
    "SUPPORTED_ARCHITECTURES",
    "load_checkpoint",
    "resolve_model_path",
]

_LAZY = {
    "Checkpoint": "argosy_runtime.model_loader.checkpoint",
    "load_checkpoint": "argosy_runtime.model_loader.load",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'argosy_runtime.model_loader' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
