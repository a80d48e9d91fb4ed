"""LoRA adapters named `s3://bucket/prefix`, downloaded from a real S3 API: moto's server on a
loopback port, reached through `AWS_ENDPOINT_URL` with fake credentials (as for MinIO or R2).
The server's request log tells which objects were read in full (200) and which only checked
(304, the ETag cache)."""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from argosy_runtime import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_engine import (  # noqa: E402
    adapters,  # noqa: F401  (fixtures)
    model_dir,  # noqa: F401
    run,
)

pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class S3:
    """moto's S3 on 127.0.0.1; `requests` logs (method, path, status) of every request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from moto.server import ThreadedMotoServer

        self.requests: list[tuple[str, str, int]] = []
        log = self.requests

        def log_request(handler: Any, code: Any = "-", size: Any = "-") -> None:
            log.append((handler.command, handler.path.split("?")[0], int(code)))

        monkeypatch.setattr(MotoRequestHandler, "log_request", log_request)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def client(self, **credentials: str) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", **credentials)

    def publish(self, bucket: str, prefix: str, folder: Path) -> None:
        client = self.client()
        if bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket=bucket)
        for name in (CONFIG, WEIGHTS):
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}",
                              Body=(folder / name).read_bytes())

    def full_reads(self, name: str) -> int:
        """GETs of objects named `name` answered with their body."""
        return sum(1 for m, p, code in self.requests if m == "GET" and p.endswith("/" + name)
                   and code == 200)

    def stop(self) -> None:
        # moto's backends are global to the process: empty them for the next test.
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/reset",
                                                      method="POST")).close()
        self.server.stop()


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3]:
    server = S3(monkeypatch)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                 "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("ARGOSY_LORA_CACHE", str(tmp_path / "cache"))
    yield server
    server.stop()


@pytest.fixture
def engine(model_dir: Path) -> LLMEngine:  # noqa: F811
    return LLMEngine(model=str(model_dir), dtype="float32")


def test_s3_adapter_generates_like_its_folder(s3: S3, model_dir: Path,  # noqa: F811
                                              adapters: dict[str, Path]) -> None:  # noqa: F811
    s3.publish("adapters", "team/sql", adapters["all"])
    # Other keys under the prefix (a checkpoint) are never downloaded.
    s3.client().put_object(Bucket="adapters", Key="team/sql/checkpoint-10/optimizer.pt",
                           Body=b"x" * 1000)
    engine = LLMEngine(model=str(model_dir), dtype="float32",
                       lora_modules={"sql": "s3://adapters/team/sql/",
                                     "folder": str(adapters["all"])})
    engine.load_lora_adapter("sql2", "s3://adapters/team/sql")  # the same, trailing / or not
    outs = run(engine, [("sql", 0), ("folder", 0), (None, 0), ("sql", 1), ("folder", 1)])
    assert outs[0] == outs[1] and outs[3] == outs[4] and outs[0] != outs[2]
    assert engine.lora_adapters["sql"].cache_salt == engine.lora_adapters["folder"].cache_salt
    assert engine.lora_adapters["sql2"].cache_salt == engine.lora_adapters["sql"].cache_salt
    assert [p for m, p, _ in s3.requests if m == "GET" and "checkpoint" in p] == []
    cached = list(Path(os.environ["ARGOSY_LORA_CACHE"]).iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("s3--adapters--team--sql-")
    assert sorted(p.name for p in cached[0].iterdir() if not p.name.startswith(".")) == [
        CONFIG, WEIGHTS]


def test_etag_cache_refetches_only_changed_objects(s3: S3, engine: LLMEngine, tmp_path: Path,
                                                   adapters: dict[str, Path]) -> None:  # noqa: F811
    s3.publish("adapters", "sql", adapters["all"])
    engine.load_lora_adapter("a", "s3://adapters/sql")
    assert s3.full_reads(WEIGHTS) == 1 and s3.full_reads(CONFIG) == 1
    before = len(s3.requests)
    # Loaded again: each object is asked for with its ETag and answers 304, no body.
    engine.load_lora_adapter("b", "s3://adapters/sql")
    assert s3.full_reads(WEIGHTS) == 1 and s3.full_reads(CONFIG) == 1
    assert [code for m, _, code in s3.requests[before:] if m == "GET"] == [304, 304]
    assert engine.lora_adapters["b"].cache_salt == engine.lora_adapters["a"].cache_salt

    # Retrained in place: the new objects have new ETags and are fetched again.
    s3.publish("adapters", "sql", adapters["attn-rs"])
    engine.load_lora_adapter("c", "s3://adapters/sql")
    assert s3.full_reads(WEIGHTS) == 2 and s3.full_reads(CONFIG) == 2
    engine.load_lora_adapter("attn", str(adapters["attn-rs"]))
    assert run(engine, [("c", 0), ("attn", 0)]) == run(engine, [("attn", 0), ("c", 0)])[::-1]
    assert engine.lora_adapters["c"].cache_salt == engine.lora_adapters["attn"].cache_salt
    assert engine.lora_adapters["c"].cache_salt != engine.lora_adapters["a"].cache_salt

    # Only the weights changed (same tensors, new metadata): only they are read again.
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapters["attn-rs"] / WEIGHTS)
    save_file(tensors, tmp_path / WEIGHTS, metadata={"format": "pt", "retrained": "1"})
    s3.client().put_object(Bucket="adapters", Key=f"sql/{WEIGHTS}",
                           Body=(tmp_path / WEIGHTS).read_bytes())
    engine.load_lora_adapter("d", "s3://adapters/sql")
    assert s3.full_reads(WEIGHTS) == 3 and s3.full_reads(CONFIG) == 2


def test_a_failed_download_leaves_no_file_a_later_load_uses(
        s3: S3, engine: LLMEngine, adapters: dict[str, Path],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    from argosy_runtime.lora import s3 as s3_module
    from botocore.exceptions import ResponseStreamingError
    from botocore.response import StreamingBody

    s3.publish("adapters", "sql", adapters["all"])
    real = StreamingBody.iter_chunks

    def cut(self: StreamingBody, chunk_size: int = 1024) -> Iterator[bytes]:
        """The connection drops after 16 KiB (the config is shorter: it arrives)."""
        chunks = real(self, 16384)
        yield next(chunks)
        for _ in chunks:
            raise ResponseStreamingError(error="connection reset")

    monkeypatch.setattr(StreamingBody, "iter_chunks", cut)
    with pytest.raises(ValueError, match=r"LoRA adapter 'a': s3://adapters/sql: cannot "
                                         r"download adapter_model.safetensors: .*connection reset"):
        engine.load_lora_adapter("a", "s3://adapters/sql")
    folder = next(Path(s3_module.cache_root()).iterdir())
    assert not (folder / WEIGHTS).exists() and not list(folder.glob("*.partial"))
    assert not (folder / f".{WEIGHTS}.etag").exists()
    monkeypatch.setattr(StreamingBody, "iter_chunks", real)
    engine.load_lora_adapter("a", "s3://adapters/sql")
    assert "a" in engine.lora_adapters


def test_missing_bucket_key_and_config_are_clear_errors(s3: S3, engine: LLMEngine,
                                                        model_dir: Path,  # noqa: F811
                                                        adapters: dict[str, Path]) -> None:  # noqa: F811
    s3.publish("adapters", "sql", adapters["all"])
    s3.client().put_object(Bucket="adapters", Key=f"weights-only/{WEIGHTS}",
                           Body=(adapters["all"] / WEIGHTS).read_bytes())
    with pytest.raises(ValueError, match=r"'x': s3://nope/sql: no bucket 'nope'"):
        engine.load_lora_adapter("x", "s3://nope/sql")
    with pytest.raises(ValueError, match=r"s3://adapters/typo: no object "
                                         r"s3://adapters/typo/adapter_config.json"):
        engine.load_lora_adapter("x", "s3://adapters/typo")
    with pytest.raises(ValueError, match=r"no object s3://adapters/weights-only/adapter_config"):
        engine.load_lora_adapter("x", "s3://adapters/weights-only")
    with pytest.raises(ValueError, match=r"expected s3://bucket/prefix"):
        engine.load_lora_adapter("x", "s3:///sql")
    assert "x" not in engine.lora_adapters
    # At startup the engine fails naming the adapter and its path.
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql': s3://adapters/typo: no object"):
        LLMEngine(model=str(model_dir), dtype="float32",
                  lora_modules={"sql": "s3://adapters/typo"})


def test_denied_and_missing_credentials_are_clear_errors(
        s3: S3, engine: LLMEngine, adapters: dict[str, Path],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    s3.publish("adapters", "sql", adapters["all"])
    iam = boto3.client("iam", endpoint_url=s3.url, region_name="us-east-1")
    iam.create_user(UserName="nobody")  # no policy: every S3 action is denied
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks IAM now
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    with pytest.raises(ValueError, match=r"s3://adapters/sql: access denied to "
                                         r"s3://adapters/sql/adapter_config.json \(AccessDenied"):
        engine.load_lora_adapter("x", "s3://adapters/sql")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")
    with pytest.raises(ValueError, match=r"access denied .*InvalidAccessKeyId"):
        engine.load_lora_adapter("x", "s3://adapters/sql")

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ValueError, match=r"s3://adapters/sql: no AWS credentials found"):
        engine.load_lora_adapter("x", "s3://adapters/sql")
    assert "x" not in engine.lora_adapters


def test_without_boto3_the_error_says_what_to_install(engine: LLMEngine,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    with pytest.raises(ValueError, match=r"s3://a/b: s3:// adapters need boto3: "
                                         r"pip install 'argosy\[s3\]'"):
        engine.load_lora_adapter("x", "s3://a/b")


def test_modules_file_retries_an_s3_adapter_until_it_exists(
        s3: S3, engine: LLMEngine, adapters: dict[str, Path],  # noqa: F811
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from argosy_runtime.lora import LoRAModulesFile

    path = tmp_path / "adapters.json"
    path.write_text(json.dumps({"sql": "s3://adapters/sql"}))
    modules = LoRAModulesFile(path)
    with caplog.at_level(logging.ERROR, logger="argosy.lora"):
        assert not modules.sync(engine) and not modules.sync(engine)
    errors = [r.getMessage() for r in caplog.records if r.name == "argosy.lora"]
    assert len(errors) == 1 and "no bucket 'adapters'" in errors[0], errors
    s3.publish("adapters", "sql", adapters["all"])
    assert modules.sync(engine) and "sql" in engine.lora_adapters


async def test_http_load_of_a_missing_s3_adapter_is_a_400(s3: S3, engine: LLMEngine) -> None:
    import httpx
    from argosy_runtime.server.app import build_app
    from argosy_runtime.server.config import ServerConfig

    app = build_app(engine, ServerConfig(allow_runtime_lora_updates=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://replica") as client:
        resp = await client.post("/v1/load_lora_adapter",
                                 json={"lora_name": "sql", "lora_path": "s3://nope/sql"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "lora_path"
    assert error["message"] == "LoRA adapter 'sql': s3://nope/sql: no bucket 'nope' (NoSuchBucket)"
