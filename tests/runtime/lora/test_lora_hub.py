"""LoRA adapters named `hf://org/name[@revision]`, downloaded from a loopback HTTP server that
answers the Hub's `/{repo}/resolve/{revision}/{file}` like huggingface.co does (token check,
404 for unknown files)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from argosy_runtime import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_engine import (  # noqa: E402
    adapters,  # noqa: F401  (fixtures)
    model_dir,  # noqa: F401
    references,  # noqa: F401
    run,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Serves `files[(repo, revision, name)] = bytes`; requires `token` when set."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str, str], bytes] = {}
        self.token: str | None = None
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hub.requests.append(self.path)
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self.send_response(401)
                    self.end_headers()
                    return
                org, name, _, revision, file = self.path.lstrip("/").split("/", 4)
                body = hub.files.get((f"{org}/{name}", revision, file))
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self, repo: str, revision: str, folder: Path) -> None:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            self.files[(repo, revision, name)] = (folder / name).read_bytes()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    server = Hub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("ARGOSY_LORA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.server.shutdown()


def test_hub_adapters_load_like_folders(hub: Hub, model_dir, adapters, references,  # noqa: F811
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    hub.publish("org/all", "main", adapters["all"])
    hub.publish("org/attn", COMMIT, adapters["attn-rs"])
    engine = LLMEngine(model=str(model_dir), dtype="float32",
                       lora_modules={"all": "hf://org/all"})
    engine.load_lora_adapter("attn", f"hf://org/attn@{COMMIT}")
    assert run(engine, [("all", 0), ("attn", 1)]) == [references["all"][0],
                                                       references["attn-rs"][1]]
    # A commit is immutable: loaded again from the cache. A branch is fetched again.
    fetched = len(hub.requests)
    engine.load_lora_adapter("attn2", f"hf://org/attn@{COMMIT}")
    assert len(hub.requests) == fetched
    engine.load_lora_adapter("all2", "hf://org/all")
    assert len(hub.requests) == fetched + 2

    hub.token = "secret"
    with pytest.raises(ValueError, match=r"hf://org/all: cannot download .*HTTP 401 .*HF_TOKEN"):
        engine.load_lora_adapter("all3", "hf://org/all")
    monkeypatch.setenv("HF_TOKEN", "secret")
    engine.load_lora_adapter("all3", "hf://org/all")
    with pytest.raises(ValueError, match="HTTP 404"):
        engine.load_lora_adapter("gone", "hf://org/missing")
    with pytest.raises(ValueError, match="expected hf://org/name"):
        engine.load_lora_adapter("bad", "hf://not-a-repo")
    assert "gone" not in engine.lora_adapters and "all3" in engine.lora_adapters
