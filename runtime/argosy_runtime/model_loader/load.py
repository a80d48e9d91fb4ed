"""`load_checkpoint`: model argument -> `Checkpoint` (spec + tokenizer + lazy weights)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from argosy_runtime.model_loader import (
    encoder_config,
    gguf_checkpoint,
    hf_checkpoint,
    lm_head_classifier,
)
from argosy_runtime.model_loader.checkpoint import Checkpoint, naming_the_file
from argosy_runtime.model_loader.gguf_metadata import check_field_types, open_gguf
from argosy_runtime.model_loader.resolve import resolve_model_path
from argosy_runtime.tokenizer import Tokenizer


def load_checkpoint(model: str | os.PathLike[str],
                    hf_overrides: dict[str, Any] | None = None) -> Checkpoint:
    """Read the spec and tokenizer of `model` (alias, HF folder or .gguf); weights stay on disk.
    `hf_overrides` replaces fields of an HF folder's config.json (vLLM's --hf-overrides).

    Raises FileNotFoundError for missing files (folder, config.json, weights, tokenizer.json)
    and ValueError for an unsupported architecture, malformed files, or overrides for a file
    that has no config.json.
    """
    path, fmt = resolve_model_path(model)
    if hf_overrides and fmt != "hf":
        raise ValueError(f"hf_overrides: {path} is a GGUF file; overrides apply to a Hugging "
                         "Face folder's config.json")
    if fmt == "hf":
        files = hf_checkpoint.safetensors_files(path)
        spec = hf_checkpoint.load_hf_spec(path, files, hf_overrides)
        tokenizer = _hf_tokenizer(path)
        tokenizer.add_eos_token_ids(spec.eos_token_ids)
        spec = lm_head_classifier.resolve_token_ids(spec, tokenizer)  # classifier_from_token
        if spec.is_encoder:  # BERT / XLM-R: sentence-transformers pooling, [SEP] for pairs
            spec = encoder_config.resolve_encoder_spec(spec, path, tokenizer)
        return Checkpoint(spec=spec, tokenizer=tokenizer, path=path, format="hf", _files=files)
    try:
        reader = open_gguf(path)
    except (ValueError, OSError, IndexError) as exc:  # IndexError: a file cut inside the header
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    with naming_the_file(path):  # the spec's and tokenizer's checks: say which file
        try:
            check_field_types(reader)  # before anything reads them: int() of a list, ...
            gguf_checkpoint.check_not_split(reader, path)
            spec = gguf_checkpoint.spec_from_gguf(reader)
            tokenizer = _gguf_tokenizer(reader)
        except KeyError as exc:  # read_field: a metadata field the model or tokenizer needs
            raise ValueError(exc.args[0]) from exc
    tokenizer.add_eos_token_ids(spec.eos_token_ids)
    return Checkpoint(spec=spec, tokenizer=tokenizer, path=path, format="gguf", _reader=reader)


def _hf_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer. The tokenizers library reports a corrupt tokenizer.json as a
    plain Exception, and a tokenizer_config.json that is not an object fails inside our
    reader: both become one ValueError naming the folder (a missing file stays an OSError)."""
    try:
        return Tokenizer.from_hf_folder(folder)
    except OSError:
        raise
    except Exception as exc:
        raise ValueError(f"{folder}: cannot read the tokenizer (tokenizer.json, "
                         f"tokenizer_config.json): {exc}") from exc


def _gguf_tokenizer(reader: Any) -> Tokenizer:
    """The file's tokenizer. Metadata the tokenizers library rejects (a merge that is not two
    tokens, a merge of tokens not in the list, duplicate tokens) comes as its plain Exception
    or TypeError: a ValueError instead, as for a folder's tokenizer.json."""
    try:
        return Tokenizer.from_gguf(reader)
    except (KeyError, ValueError):  # a missing field; our own checks: messages of their own
        raise
    except Exception as exc:
        raise ValueError(f"cannot build the tokenizer from its tokenizer.ggml.* metadata: "
                         f"{exc}") from exc
