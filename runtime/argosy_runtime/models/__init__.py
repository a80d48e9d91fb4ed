"""Model definitions. One decoder family today: Llama (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

from argosy_runtime.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

__all__ = ["LlamaForCausalLM", "SUPPORTED_ARCHITECTURES"]
