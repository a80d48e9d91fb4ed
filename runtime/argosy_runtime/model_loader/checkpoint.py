"""`Checkpoint`: a model's spec, tokenizer and a lazy stream of its weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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
from argosy_runtime.model_loader.gguf_metadata import open_gguf, read_field
from argosy_runtime.model_loader.model_spec import ModelSpec
from argosy_runtime.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """A loaded model checkpoint. Weights are read only when `iter_weights` is iterated.

    `format` is "hf" (folder of safetensors) or "gguf"; `path` is the folder or the .gguf file.
    A GGUF checkpoint does not keep its file mapped: the reader `load_checkpoint` parsed goes to
    the first pass over the weights and is dropped with it; a later pass opens the file again
    (so a served model holds no mapping of a file it has finished reading: deleting the file
    frees its disk space, and its pages leave the process).
    """

    spec: ModelSpec
    tokenizer: Tokenizer
    path: Path
    format: str
    _files: list[Path] = field(default_factory=list, repr=False, compare=False)
    _reader: GGUFReader | None = field(default=None, repr=False, compare=False)
    _gguf_arch: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._reader is not None:  # gguf_rope_heads asks for it once per tensor
            self._gguf_arch = read_field(self._reader, "general.architecture")

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
            with naming_the_file(self.path):
                yield from gguf_checkpoint.iter_dequantized(self._take_reader(), self.spec)

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
        with naming_the_file(self.path):
            yield from gguf_checkpoint.iter_raw_tensors(self._take_reader(), self.spec)

    def gguf_rope_heads(self, hf_name: str) -> int | None:
        """GGUF only: head count for undoing the q/k row permutation of `hf_name`, or None."""
        if self._gguf_arch is None:
            self._gguf_arch = read_field(self.gguf_reader, "general.architecture")
        return gguf_checkpoint.rope_heads_for(self._gguf_arch, hf_name, self.spec)

    @property
    def gguf_reader(self) -> GGUFReader:
        """A GGUFReader of the file (GGUF checkpoints only): the one `load_checkpoint` parsed
        until a pass over the weights takes it, else a new one, which maps the file until the
        caller drops it."""
        if self.format != "gguf":
            raise ValueError(f"checkpoint {self.path} is not a GGUF file")
        return self._reader if self._reader is not None else open_gguf(self.path)

    def _take_reader(self) -> GGUFReader:
        """The reader for one pass over the tensors, not kept by the checkpoint: the tensors
        (and the mapping of the file) are released when the pass ends."""
        reader = self.gguf_reader
        self._reader = None
        return reader

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights at once (convenience for tests and small models)."""
        return dict(self.iter_weights())


@contextmanager
def naming_the_file(path: Path) -> Iterator[None]:
    """A ValueError raised inside (a GGUF tensor's unsupported type or wrong shape, a
    metadata check) gets the file's path in front, unless it already names it."""
    try:
        yield
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc
