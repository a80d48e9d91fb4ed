"""Argosy runtime: an LLM inference engine with an OpenAI-compatible server.

The public names are imported lazily so that light-weight parts of the package (the CLI
dispatcher, the gateway) never pay for, or require, an import of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "LLMEngine", "SamplingParams", "PoolingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "ClassificationOutput", "EngineArgs",
           "BeamSearchParams"]

_LAZY = {
    "LLM": "argosy_runtime.llm",
    "LLMEngine": "argosy_runtime.engine",
    "SamplingParams": "argosy_runtime.sampling_params",
    "PoolingParams": "argosy_runtime.pooling_params",
    "StructuredOutputsParams": "argosy_runtime.structured_output",
    "RequestOutput": "argosy_runtime.outputs",
    "CompletionOutput": "argosy_runtime.outputs",
    "ClassificationOutput": "argosy_runtime.outputs",
    "EngineArgs": "argosy_runtime.engine_args",
    "BeamSearchParams": "argosy_runtime.beam_search",
}

if TYPE_CHECKING:  # pragma: no cover
    from argosy_runtime.beam_search import BeamSearchParams
    from argosy_runtime.engine import LLMEngine
    from argosy_runtime.engine_args import EngineArgs
    from argosy_runtime.llm import LLM
    from argosy_runtime.outputs import ClassificationOutput, CompletionOutput, RequestOutput
    from argosy_runtime.pooling_params import PoolingParams
    from argosy_runtime.sampling_params import SamplingParams
    from argosy_runtime.structured_output import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'argosy_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
