"""hf:// downloads that the Hub redirects: huggingface.co answers `resolve` of an LFS file
(every adapter_model.safetensors) with a redirect to a signed URL on another host (its CDN,
or S3 behind a mirror). `HF_TOKEN` must not follow it there, as huggingface_hub drops it
("url is signed => don't send auth"): the token would leak to that host, and S3 refuses a
presigned URL that also carries an Authorization header (400, "Only one auth mechanism
allowed"). A redirect within the Hub's own host (a renamed repo) keeps the token."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from argosy_runtime.lora import hub

CONFIG = b'{"r": 4, "lora_alpha": 8}'
WEIGHTS = b"safetensors bytes"


class _Server:
    """A loopback HTTP server; `handle(handler)` answers each GET; `seen` records
    (path, Authorization header)."""

    def __init__(self, handle) -> None:  # noqa: ANN001
        self.seen: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                server.seen.append((self.path, self.headers.get("Authorization")))
                handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _reply(handler: BaseHTTPRequestHandler, code: int, body: bytes = b"",
           location: str | None = None) -> None:
    handler.send_response(code)
    if location is not None:
        handler.send_header("Location", location)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Server, _Server]]:
    def cdn_handle(h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization"):  # S3's answer to a presigned URL plus a header
            _reply(h, 400, b"InvalidArgument: Only one auth mechanism allowed")
        else:
            _reply(h, 200, WEIGHTS)

    cdn = _Server(cdn_handle)

    def hub_handle(h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization") != "Bearer secret":
            _reply(h, 401)
        elif h.path.startswith("/old/name/"):  # renamed repo: same host, token kept
            _reply(h, 307, location=h.path.replace("/old/name/", "/org/name/", 1))
        elif h.path == "/org/name/resolve/main/adapter_config.json":
            _reply(h, 200, CONFIG)
        elif h.path == "/org/name/resolve/main/adapter_model.safetensors":
            _reply(h, 302, location=f"{cdn.url}/blob?X-Amz-Signature=abc")
        else:
            _reply(h, 404)

    hub_server = _Server(hub_handle)
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setenv("ARGOSY_LORA_CACHE", str(tmp_path / "cache"))
    yield hub_server, cdn
    hub_server.httpd.shutdown()
    cdn.httpd.shutdown()


def test_the_token_does_not_follow_a_redirect_to_another_host(servers) -> None:  # noqa: ANN001
    hub_server, cdn = servers
    folder = hub.download_adapter("hf://org/name")
    assert (folder / "adapter_config.json").read_bytes() == CONFIG
    assert (folder / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert cdn.seen == [("/blob?X-Amz-Signature=abc", None)]  # no token sent to the CDN
    assert all(auth == "Bearer secret" for _, auth in hub_server.seen)


def test_a_redirect_within_the_hub_keeps_the_token(servers) -> None:  # noqa: ANN001
    hub_server, cdn = servers
    folder = hub.download_adapter("hf://old/name")
    assert (folder / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert [auth for path, auth in hub_server.seen if path.startswith("/org/")] == [
        "Bearer secret", "Bearer secret"]
    assert cdn.seen == [("/blob?X-Amz-Signature=abc", None)]


@pytest.mark.parametrize("path", ["hf://org/..", "hf://org/../x", "hf://org/a..b"])
def test_dot_dot_in_a_repo_name_is_refused(path: str) -> None:
    """The Hub forbids ".." in repo ids; "hf://org/.." resolved `{endpoint}/org/../resolve/..`,
    a URL outside any repo, with the token."""
    with pytest.raises(ValueError, match="expected hf://org/name"):
        hub.parse_hub_path(path)


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_download_cut_short_is_an_error_and_caches_nothing(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             chunked: bool) -> None:
    """The connection closes before the body's end. http.client returns the bytes it got
    without complaint when the length was given (Content-Length): the truncated file was
    renamed into the cache, where a commit is never fetched again, so the adapter failed
    every load from then on. A cut chunked body raised http.client.IncompleteRead, not the
    ValueError callers turn into a 400 (a 500; the modules file's round stopped)."""
    full = {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS * 100}
    cut = {"on": True}

    def handle(h: BaseHTTPRequestHandler) -> None:
        body = full.get(h.path.rsplit("/", 1)[-1])
        if body is None:
            _reply(h, 404)
            return
        h.send_response(200)
        if chunked:
            h.send_header("Transfer-Encoding", "chunked")
        else:
            h.send_header("Content-Length", str(len(body)))
        h.send_header("Connection", "close")
        h.end_headers()
        sent = body[: len(body) // 2] if cut["on"] and body is not CONFIG else body
        h.wfile.write(b"%x\r\n%s\r\n" % (len(sent), sent) if chunked else sent)
        if chunked and sent is body:
            h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()
        h.close_connection = True

    server = _Server(handle)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("ARGOSY_LORA_CACHE", str(tmp_path / "cache"))
    try:
        with pytest.raises(ValueError, match=f"hf://org/name@{COMMIT}: cannot download "
                                             "adapter_model.safetensors"):
            hub.download_adapter(f"hf://org/name@{COMMIT}")
        assert not list((tmp_path / "cache").rglob("adapter_model.safetensors"))
        assert not list((tmp_path / "cache").rglob("*.partial"))
        cut["on"] = False
        folder = hub.download_adapter(f"hf://org/name@{COMMIT}")
        assert (folder / "adapter_model.safetensors").read_bytes() == full[
            "adapter_model.safetensors"]
    finally:
        server.httpd.shutdown()
