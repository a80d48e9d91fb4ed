"""The init container's Hugging Face downloader, run for real against a loopback hub."""

from __future__ import annotations

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


class Hub(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        Hub.requests.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != "Bearer hf_secret":
            self.send_error(401)
            return
        if self.path == "/api/models/org/tiny/revision/v1.0":
            body = json.dumps({"siblings": [{"rfilename": f} for f in FILES]}).encode()
        elif self.path.startswith("/org/tiny/resolve/v1.0/"):
            name = self.path.removeprefix("/org/tiny/resolve/v1.0/")
            if name not in FILES:
                self.send_error(404)
                return
            body = FILES[name]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    Hub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run(hub: str, dest: Path, only: str = "", token: str = "hf_secret"
        ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_TOKEN": token}
    return subprocess.run([sys.executable, "-c", HF_DOWNLOAD_SCRIPT, "org/tiny", "v1.0", only,
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
