"""Write a Hugging Face folder (bf16 safetensors + tokenizer) of a model Argosy loads.

Peers such as vLLM's CPU build want an HF folder; the embedded model ships as GGUF. Both
engines then read exactly the same (dequantized) weights.

    .venv/bin/python bench/export_hf.py smollm2-135m /tmp/smollm2-hf
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from argosy_runtime.model_loader import load_checkpoint, resolve_model_path
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def main(model: str, out_dir: str) -> None:
    ckpt = load_checkpoint(model)
    s = ckpt.spec
    if s.architecture != "llama":
        raise SystemExit(f"only llama-architecture models are exported, got {s.architecture}")
    config = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.head_dim,
        rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings, bos_token_id=s.bos_token_id,
        eos_token_id=list(s.eos_token_ids),
    )
    hf = LlamaForCausalLM(config)
    hf.load_state_dict(dict(ckpt.iter_weights()), strict=not s.tie_word_embeddings)
    hf.to(torch.bfloat16).save_pretrained(out_dir)
    path, fmt = resolve_model_path(model)
    if fmt == "gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.save_pretrained(out_dir)
    # Argosy's own tokenizer.json over transformers' conversion: transformers' GGUF loader
    # drops pre-tokenizer steps llama.cpp applies (SmolLM2's digit split), so a peer reading
    # the folder would tokenize some texts differently from Argosy.
    ckpt.tokenizer.backend.save(str(Path(out_dir) / "tokenizer.json"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
