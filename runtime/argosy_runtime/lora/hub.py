"""LoRA adapters from the Hugging Face Hub: `hf://org/name` (or `hf://org/name@revision`).

An adapter path may name a Hub repo instead of a folder: its `adapter_config.json` and
`adapter_model.safetensors` are downloaded into `$ARGOSY_LORA_CACHE` (default
`$XDG_CACHE_HOME/argosy/lora`, `/tmp/.cache/argosy/lora` in the operator's pods), then loaded
as a folder. Adapters are small (megabytes), so a branch or tag is fetched again at every load
(a retrained adapter pushed to `main` is picked up by the next load); a 40-hex commit is
immutable and fetched once. Files land under a temporary name and are renamed, so a
half-downloaded adapter is never loaded. `HF_TOKEN` authenticates (private repos),
`HF_ENDPOINT` points at a mirror. Standard library only, like the operator's model download.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SCHEME = "hf://"
FILES = ("adapter_config.json", "adapter_model.safetensors")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_hub_path(path: str | Path) -> bool:
    return str(path).startswith(SCHEME)


def parse_hub_path(path: str) -> tuple[str, str]:
    """`hf://org/name[@revision]` -> (repo, revision); ValueError naming what is wrong."""
    repo, _, revision = path[len(SCHEME):].partition("@")
    # ".." as the Hub forbids it: "hf://org/.." would resolve outside the repo's URLs
    # (`{endpoint}/org/../resolve/...`), with the token.
    if not _REPO.match(repo) or ".." in repo:
        raise ValueError(f"{path}: expected hf://org/name or hf://org/name@revision")
    return repo, revision or "main"


def looks_like_repo_id(path: str) -> bool:
    """`org/name` (or `org/name@revision`): what vLLM takes as a Hub repo id."""
    try:
        parse_hub_path(SCHEME + path)
    except ValueError:
        return False
    return True


def cache_root() -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("ARGOSY_LORA_CACHE", cache_home / "argosy" / "lora"))


def write_atomic(target: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to a unique temporary file beside `target`, then rename it over: a
    reader never sees a half file, and concurrent writers never mix their bytes (hf:// and
    s3:// downloads)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def make_cache_folder(path: str, folder: Path) -> None:
    """Create `folder` in the adapter cache; ValueError naming `path` if it cannot be (a
    read-only home in a container): a bare OSError would be a 500 for each request."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{path}: cannot create the adapter cache folder {folder}: {exc} "
                         "(set ARGOSY_LORA_CACHE to a writable folder)") from exc


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


class _NoTokenElsewhere(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but not with the token to another host: the Hub redirects LFS
    files (adapter_model.safetensors) to signed URLs on its CDN or S3, where the token would
    leak and S3 refuses a presigned URL that also carries an Authorization header (400).
    huggingface_hub drops it the same way; urllib's default handler keeps every header."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _body(resp: Any) -> Iterator[bytes]:
    """`resp`'s body in chunks; IncompleteRead when it ends before its Content-Length
    (http.client then returns what it got without complaint: a truncated file renamed into
    the cache, where a commit is never fetched again)."""
    expected = resp.headers.get("Content-Length")
    if "chunked" in resp.headers.get("Transfer-Encoding", "").lower():
        expected = None  # the length is the chunks' (http.client checks them itself)
    received = 0
    while chunk := resp.read(1 << 20):
        received += len(chunk)
        yield chunk
    if expected is not None and expected.isdigit() and received != int(expected):
        raise http.client.IncompleteRead(b"", int(expected) - received)


def download_adapter(path: str, timeout: float = 60.0) -> Path:
    """The local folder holding the adapter `path` names (downloaded as the module says)."""
    repo, revision = parse_hub_path(path)
    key = hashlib.sha256(f"{repo}@{revision}".encode()).hexdigest()[:16]
    folder = cache_root() / f"{repo.replace('/', '--')}-{key}"
    if _COMMIT.match(revision) and all((folder / name).is_file() for name in FILES):
        return folder
    make_cache_folder(path, folder)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = {"User-Agent": "argosy-lora-download"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = "Bearer " + os.environ["HF_TOKEN"]
    quoted = urllib.parse.quote(revision, safe="")
    opener = urllib.request.build_opener(_NoTokenElsewhere)
    for name in FILES:
        url = f"{endpoint}/{repo}/resolve/{quoted}/{name}"
        try:
            with opener.open(urllib.request.Request(url, headers=headers),
                             timeout=timeout) as resp:
                write_atomic(folder / name, _body(resp))
        except urllib.error.HTTPError as exc:
            hint = " (private? set HF_TOKEN)" if exc.code in (401, 403) else ""
            raise ValueError(f"{path}: cannot download {name}: HTTP {exc.code}{hint}") from exc
        # HTTPException: http.client.IncompleteRead, a chunked body cut short.
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise ValueError(f"{path}: cannot download {name}: {exc}") from exc
    return folder
