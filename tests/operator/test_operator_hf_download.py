"""The init container's Hugging Face downloader, run for real against a loopback hub."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from argosy_operator.builders.hf_download import HF_DOWNLOAD_SCRIPT

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00" * 3_000_000,
         "tokenizer.json": b"{}", "pytorch_model.bin": b"old", "README.md": b"# hi",
         ".gitattributes": b"*", "gguf/model.Q4.gguf": b"GGUF"}
# Mistral's layout: the sharded checkpoint the index lists, and the same weights once more in
# consolidated.safetensors (its own format, which the runtime never loads).
SHARDED = {"config.json": b"{}", "model.safetensors.index.json": json.dumps({"weight_map": {
    "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode(),
    "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
    "consolidated.safetensors": b"12"}
# None: the hub redirects to the CDN, as huggingface.co does for weights (a signed URL).
LFS: dict[str, bytes | None] = {"config.json": b"{}", "model.safetensors": None}
REPOS: dict[str, dict[str, bytes | None]] = {"org/tiny": FILES, "org/sharded": SHARDED,
                                              "org/lfs": LFS}
CDN_BODY = b"weights"


class Hub(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, str | None]] = []
    cdn = ""  # the CDN server's URL

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        Hub.requests.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != "Bearer hf_secret":
            self.send_error(401)
            return
        repo, listing, name = self._route()
        if repo is None or (not listing and name not in REPOS[repo]):
            self.send_error(404)
            return
        if listing:
            body = json.dumps({"siblings": [{"rfilename": f} for f in REPOS[repo]]}).encode()
        else:
            body = REPOS[repo][name]
        if body is None:
            self.send_response(302)
            self.send_header("Location", f"{Hub.cdn}/{name}?signature=s")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> tuple[str | None, bool, str]:
        """(repo, whether the file listing is asked for, file name) of the request path."""
        for repo in REPOS:
            if self.path == f"/api/models/{repo}/revision/v1.0":
                return repo, True, ""
            if self.path.startswith(f"/{repo}/resolve/v1.0/"):
                return repo, False, self.path.removeprefix(f"/{repo}/resolve/v1.0/")
        return None, False, ""

    def log_message(self, *args: Any) -> None:
        pass


class Cdn(http.server.BaseHTTPRequestHandler):
    """Serves a signed URL; a request that also carries an Authorization header is refused,
    as stores with signed URLs do (two authentication mechanisms)."""

    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        Cdn.requests.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization"):
            self.send_error(400)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(CDN_BODY)))
        self.end_headers()
        self.wfile.write(CDN_BODY)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def hub() -> Iterator[str]:
    Hub.requests, Cdn.requests = [], []
    with _serve(Cdn) as cdn, _serve(Hub) as url:
        Hub.cdn = cdn
        yield url


def run(hub: str, dest: Path, only: str = "", token: str = "hf_secret", repo: str = "org/tiny"
        ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_TOKEN": token}
    return subprocess.run([sys.executable, "-c", HF_DOWNLOAD_SCRIPT, repo, "v1.0", only,
                           str(dest)], env=env, capture_output=True, text=True, timeout=60)


def test_downloads_what_the_runtime_loads_once(hub: str, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    out = run(hub, dest)
    assert out.returncode == 0, out.stderr
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == [".argosy-download-complete", "config.json", "model.safetensors",
                   "tokenizer.json"]
    assert (dest / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    served = len(Hub.requests)
    again = run(hub, dest)  # a restarted pod: the emptyDir survived, nothing is fetched
    assert again.returncode == 0 and "already downloaded" in again.stdout
    assert len(Hub.requests) == served


def test_only_the_shards_the_index_lists(hub: str, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    out = run(hub, dest, repo="org/sharded")
    assert out.returncode == 0, out.stderr
    got = sorted(p.name for p in dest.iterdir())
    assert got == [".argosy-download-complete", "config.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert "/org/sharded/resolve/v1.0/consolidated.safetensors" not in [p for p, _ in Hub.requests]


def test_the_token_goes_to_the_hub_not_to_the_cdn_it_redirects_to(hub: str, tmp_path: Path
                                                                   ) -> None:
    dest = tmp_path / "model"
    out = run(hub, dest, repo="org/lfs")
    assert out.returncode == 0, out.stderr
    assert (dest / "model.safetensors").read_bytes() == CDN_BODY
    assert Cdn.requests == [("/model.safetensors?signature=s", None)]
    assert {auth for _, auth in Hub.requests} == {"Bearer hf_secret"}


def test_one_gguf_file(hub: str, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    out = run(hub, dest, only="gguf/model.Q4.gguf")
    assert out.returncode == 0, out.stderr
    assert (dest / "gguf" / "model.Q4.gguf").read_bytes() == b"GGUF"
    assert [p for p, _ in Hub.requests] == ["/org/tiny/resolve/v1.0/gguf/model.Q4.gguf"]


def test_bad_token_fails_the_container(hub: str, tmp_path: Path) -> None:
    out = run(hub, tmp_path / "model", token="wrong")
    assert out.returncode != 0
    assert "401" in out.stderr
    assert not (tmp_path / "model" / ".argosy-download-complete").exists()
