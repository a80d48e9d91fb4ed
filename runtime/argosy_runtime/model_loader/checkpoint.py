"""`Checkpoint`: a model's spec, tokenizer and a lazy stream of its weights."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGUFReader, ReaderTensor

from argosy_runtime.model_loader import (
    encoder_config,
    gguf_checkpoint,
    hf_checkpoint,
    lm_head_classifier,
)
from argosy_runtime.model_loader.gguf_metadata import read_field
from argosy_runtime.model_loader.model_spec import ModelSpec
from argosy_runtime.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """A loaded model checkpoint. Weights are read only when `iter_weights` is iterated.

    `format` is "hf" (folder of safetensors) or "gguf"; `path` is the folder or the .gguf file.
    """

    spec: ModelSpec
    tokenizer: Tokenizer
    path: Path
    format: str
    _files: list[Path] = field(default_factory=list, repr=False, compare=False)
    _reader: GGUFReader | None = field(default=None, repr=False, compare=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) for every weight the forward needs.

        Names: model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
        (+ q/k/v .bias when spec.attention_bias), model.layers.{i}.mlp.{gate,up,down}_proj.weight,
        (an MoE layer's per-expert Hub names instead: hf_checkpoint._mlp_weight_names),
        model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, and
        lm_head.weight unless spec.tie_word_embeddings or not spec.has_lm_head, and a
        classifier's score.weight (spec.num_labels > 0) instead of lm_head (made of lm_head
        rows for a `classifier_from_token` reranker: lm_head_classifier.py). A headless
        checkpoint's unprefixed names come with the `model.` prefix too. HF tensors come in
        their stored dtype; GGUF tensors are dequantized to float32 with llama.cpp's q/k row
        permutation undone.
        """
        if self.format == "hf" and self.spec.is_encoder:  # BERT / XLM-R: models/bert.py names
            yield from encoder_config.iter_encoder_weights(self._files, self.spec)
        elif self.format == "hf":
            weights = hf_checkpoint.iter_hf_weights(self._files, self.spec)
            if self.spec.classifier_method:  # a reranker's head made of lm_head rows
                weights = lm_head_classifier.convert_weights(weights, self.spec)
            yield from weights
        else:
            yield from gguf_checkpoint.iter_dequantized(self.gguf_reader, self.spec)

    def iter_raw_gguf_tensors(self) -> Iterator[tuple[str, ReaderTensor | torch.Tensor]]:
        """GGUF only: (HF name, gguf ReaderTensor) with data still in its stored quantization.

        The q/k rows of Llama-family files are still rope-permuted: apply
        `undo_rope_permutation(rows, self.gguf_rope_heads(name))` where that is not None.
        Tensors llama.cpp stores in another layout (merged MoE experts, Phi-3's fused qkv and
        gate-up, Gemma 3's shifted norms) come already dequantized, as float32 torch tensors
        in HF layout (`gguf_checkpoint.iter_raw_tensors`).
        """
        if self.format != "gguf":
            raise ValueError(f"iter_raw_gguf_tensors needs a GGUF checkpoint, this one is {self.format!r}")
        yield from gguf_checkpoint.iter_raw_tensors(self.gguf_reader, self.spec)

    def gguf_rope_heads(self, hf_name: str) -> int | None:
        """GGUF only: head count for undoing the q/k row permutation of `hf_name`, or None."""
        arch = read_field(self.gguf_reader, "general.architecture")
        return gguf_checkpoint.rope_heads_for(arch, hf_name, self.spec)

    @property
    def gguf_reader(self) -> GGUFReader:
        """The open GGUFReader (GGUF checkpoints only)."""
        if self._reader is None:
            raise ValueError(f"checkpoint {self.path} is not a GGUF file")
        return self._reader

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights at once (convenience for tests and small models)."""
        return dict(self.iter_weights())
