"""Where the weights come from: `hf://`, `s3://`, `pvc://` URIs, or a path in the image.

`ModelSource.serve_path` is what the runtime gets as `--model`: downloads land in the shared
`/models` volume, PVCs are mounted read-only under `/models/pvc`.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Literal

from argosy_operator.constants import MODEL_MOUNT
from argosy_operator.spec import InvalidSpecError

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[\w./-]+))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>.+)$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?:/(?P<path>.*))?$")

DOWNLOAD_DIR = f"{MODEL_MOUNT}/model"
PVC_MOUNT = f"{MODEL_MOUNT}/pvc"

SourceKind = Literal["hf", "s3", "pvc", "image"]


@dataclass(frozen=True)
class ModelSource:
    """A parsed model source. `file` is set when the source names one file (a GGUF)."""

    kind: SourceKind
    location: str  # hf: org/name; s3: s3://bucket/key; pvc: claim name; image: the path/alias
    file: str | None = None  # hf: file inside the repo
    subpath: str = ""  # pvc: path inside the claim
    single_file: bool = False  # s3: the key is one file, not a prefix

    @property
    def needs_download(self) -> bool:
        return self.kind in ("hf", "s3")

    @property
    def serve_path(self) -> str:
        """The `--model` argument of `argosy serve`."""
        if self.kind == "image":
            return self.location
        if self.kind == "pvc":
            return posixpath.join(PVC_MOUNT, self.subpath) if self.subpath else PVC_MOUNT
        if self.kind == "hf":
            return posixpath.join(DOWNLOAD_DIR, self.file) if self.file else DOWNLOAD_DIR
        if self.single_file:
            return posixpath.join(DOWNLOAD_DIR, posixpath.basename(self.location))
        return DOWNLOAD_DIR


def parse_model_source(source: str | None, path: str | None, fmt: str = "auto") -> ModelSource:
    """Parse spec.model.source / spec.model.path; raise InvalidSpecError naming the field."""
    if path:
        if source:
            raise InvalidSpecError("spec.model: set exactly one of source or path")
        return ModelSource(kind="image", location=path)
    if not source:
        raise InvalidSpecError("spec.model: set exactly one of source or path")
    # fullmatch: `$` alone also matches before a final newline, which the CRD's pattern
    # refuses (an older CRD without the pattern let it through).
    if m := _HF.fullmatch(source):
        file = m.group("file")
        if fmt == "gguf" and not (file and file.endswith(".gguf")):
            raise InvalidSpecError("spec.model.source: format gguf with hf:// must name the "
                                   ".gguf file (hf://org/name/file.gguf)")
        return ModelSource(kind="hf", location=m.group("repo"), file=file)
    if m := _S3.fullmatch(source):
        key = m.group("key")
        single = fmt == "gguf" or (fmt == "auto" and key.endswith(".gguf"))
        return ModelSource(kind="s3", location=source, single_file=single and not key.endswith("/"))
    if m := _PVC.fullmatch(source):
        subpath = (m.group("path") or "").strip("/")
        if ".." in subpath.split("/"):
            raise InvalidSpecError("spec.model.source: pvc:// path must not contain '..'")
        return ModelSource(kind="pvc", location=m.group("claim"), subpath=subpath)
    raise InvalidSpecError(f"spec.model.source: {source!r} is not hf://org/name[/file], "
                           "s3://bucket/key or pvc://claim[/path]")
