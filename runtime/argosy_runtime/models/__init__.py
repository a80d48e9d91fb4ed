"""Model definitions. One decoder family today: Llama (Llama 2/3, SmolLM2, Mistral, Qwen2,
Qwen3)."""

from argosy_runtime.model_loader.model_spec import SUPPORTED_ARCHITECTURES
from argosy_runtime.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "SUPPORTED_ARCHITECTURES"]
