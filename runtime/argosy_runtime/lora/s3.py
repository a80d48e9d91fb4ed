"""LoRA adapters from S3 and S3-compatible stores: `s3://bucket/prefix`.

An adapter path may name an S3 prefix instead of a folder: the two PEFT files under it,
`<prefix>/adapter_config.json` and `<prefix>/adapter_model.safetensors`, are downloaded into
`$ARGOSY_LORA_CACHE` (as for `hf://`, lora/hub.py), in a folder keyed by endpoint, bucket and
prefix, then loaded as a folder. Only those two keys are read (GetObject on each, so the
credentials need `s3:GetObject` and no `s3:ListBucket`); anything else under the prefix
(checkpoints, READMEs, optimizer states) is never downloaded.

Caching: each file's ETag is kept beside it, and a load asks S3 for the file only if its
ETag changed (a conditional GET, `If-None-Match`: an unchanged file answers 304 with no body),
so an adapter overwritten in place is fetched again by the next load and an unchanged one costs
two small requests. Files land under a unique temporary name and are renamed, and the ETag is
written after its file, so a crash never leaves a half file that a later load uses (at worst
an ETag older than its file, which only causes one more download). A lock file serializes
loads of one adapter across threads and processes sharing the cache.

Credentials, region and endpoint come from boto3's standard chain: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_PROFILE` and the shared config files, web
identity (IRSA) or instance/container roles; `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` point
it at an S3-compatible store (MinIO, GCS's XML API, Cloudflare R2). boto3 is the optional
extra `argosy[s3]` (the runtime images have it) and is imported only when an s3:// adapter is
loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from argosy_runtime.lora.hub import FILES, cache_root, make_cache_folder, write_atomic

SCHEME = "s3://"
_BUCKET = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # lenient: GCS and R2 accept more than S3
_UNSAFE = re.compile(r"[^\w.-]+")


def is_s3_path(path: str | Path) -> bool:
    return str(path).startswith(SCHEME)


def parse_s3_path(path: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without a trailing slash; "" for the bucket's
    root); ValueError naming what is wrong."""
    bucket, _, prefix = path[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{path}: expected s3://bucket/prefix (the prefix holding "
                         "adapter_config.json and adapter_model.safetensors)")
    return bucket, prefix.strip("/")


def _client() -> Any:
    """An S3 client from boto3's default chain (env, shared files, roles; AWS_ENDPOINT_URL)."""
    import boto3
    from botocore.config import Config

    # A fresh session per load: credentials rotated in the environment or files apply.
    return boto3.session.Session().client(
        "s3", config=Config(connect_timeout=10, read_timeout=60,
                            retries={"mode": "standard", "max_attempts": 3}))


def cache_folder(bucket: str, prefix: str, endpoint: str) -> Path:
    """Where the adapter at s3://bucket/prefix on `endpoint` is cached: readable names, and a
    hash so that equal bucket/prefix names on two stores never share a folder."""
    key = hashlib.sha256(f"{endpoint}\n{bucket}/{prefix}".encode()).hexdigest()[:16]
    readable = _UNSAFE.sub("_", f"{bucket}--{prefix.replace('/', '--')}".strip("-"))[:96]
    return cache_root() / f"s3--{readable}-{key}"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _describe(path: str, bucket: str, key: str, exc: Exception) -> str:
    """A one-line reason for a failed GetObject, naming the object and what to check."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    name = key.rsplit("/", 1)[-1]
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return (f"{path}: no AWS credentials found ({exc}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the pod a role")
    if not isinstance(exc, ClientError):
        return f"{path}: cannot download {name}: {exc}"
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code == "NoSuchBucket":
        return f"{path}: no bucket {bucket!r} (NoSuchBucket)"
    if code in ("NoSuchKey", "404") or status == 404:
        return (f"{path}: no object s3://{bucket}/{key} (NoSuchKey); an s3:// adapter is a "
                "prefix holding adapter_config.json and adapter_model.safetensors")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                "ExpiredToken", "InvalidToken", "403") or status == 403:
        return (f"{path}: access denied to s3://{bucket}/{key} ({code}: "
                f"{error.get('Message', '')}); check the AWS credentials and that they "
                "allow s3:GetObject on it")
    return f"{path}: cannot download {name}: {code or status} {error.get('Message', '')}".strip()


def download_adapter(path: str) -> Path:
    """The local folder holding the adapter `path` names (downloaded as the module says).
    ValueError, naming `path` and the reason, for anything that stops the download."""
    bucket, prefix = parse_s3_path(path)
    try:
        import boto3  # noqa: F401
        import botocore.exceptions
    except ImportError as exc:
        raise ValueError(f"{path}: s3:// adapters need boto3: pip install 'argosy[s3]'") from exc
    try:
        client = _client()
    except botocore.exceptions.BotoCoreError as exc:  # e.g. an unknown AWS_PROFILE
        raise ValueError(f"{path}: cannot create an S3 client: {exc}") from exc
    folder = cache_folder(bucket, prefix, client.meta.endpoint_url)
    make_cache_folder(path, folder)
    with _locked(folder):
        for name in FILES:
            key = f"{prefix}/{name}" if prefix else name
            target, etag_file = folder / name, folder / f".{name}.etag"
            request: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if target.is_file() and etag_file.is_file():
                request["IfNoneMatch"] = etag_file.read_text().strip()
            try:
                response = client.get_object(**request)
                write_atomic(target, response["Body"].iter_chunks(1 << 20))
            except botocore.exceptions.ClientError as exc:
                meta = exc.response.get("ResponseMetadata", {})
                if meta.get("HTTPStatusCode") == 304:  # unchanged since the cached copy
                    continue
                raise ValueError(_describe(path, bucket, key, exc)) from exc
            except (botocore.exceptions.BotoCoreError, OSError) as exc:
                raise ValueError(_describe(path, bucket, key, exc)) from exc
            # After the file: an ETag never vouches for content that is not on disk.
            write_atomic(etag_file, iter([response["ETag"].encode()]))
    return folder
