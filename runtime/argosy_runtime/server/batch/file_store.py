"""Files of the Batch API: uploaded request files and the output files batches write.

Each file is two entries in `<root>/files/`: `<id>` (the bytes) and `<id>.json` (the OpenAI
`FileObject`). Writes go to a temporary name first and are renamed into place, so a crash
never leaves a half-written file behind a valid id.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from argosy_runtime.server.errors import APIError
from argosy_runtime.server.owners import visible_to

# OpenAI's limit for batch input files (200 MiB). The gateway accepts uploads up to the same
# size (gateway/proxy/batch_routes.py), so whatever a replica takes passes through it.
MAX_FILE_BYTES = 200 * 1024 * 1024


def file_too_large(limit: int) -> str:
    """The 413 message for an upload over `limit` bytes (the gateway's and a replica's)."""
    return (f"file is larger than the upload limit of {limit} bytes "
            f"({limit / 2**20:g} MiB); split it into smaller batch files")


class FileStore:
    def __init__(self, root: Path, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def create(self, source: BinaryIO, filename: str, purpose: str,
               owner: str | None = None, expires_after_s: int | None = None) -> dict[str, Any]:
        """Copy an upload into the store (at most `max_bytes`; more is a 413), as `owner`'s
        (owners.py; None: nobody's); gone `expires_after_s` seconds after its creation (None:
        kept until deleted)."""
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch' (this server keeps files for the "
                                f"Batch API only), got {purpose!r}", param="purpose")
        file_id, created_at = new_id("file-")
        tmp = self.dir / f".{file_id}.part"
        size = 0
        try:
            with tmp.open("wb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise APIError(413, file_too_large(self.max_bytes), param="file",
                                       code="file_too_large")
                    out.write(chunk)
            if size == 0:
                raise APIError(400, "file is empty", param="file")
            tmp.rename(self.dir / file_id)
        finally:
            tmp.unlink(missing_ok=True)
        return self._write_meta(file_id, filename, purpose, size, owner, created_at,
                                expires_after_s)

    def adopt(self, path: Path, filename: str, file_id: str, owner: str | None = None,
              expires_after_s: int | None = None) -> dict[str, Any]:
        """Put a finished batch's result file into the store as `batch_output`, under the id
        its batch chose. `path` stays where it is (a hard link, else a copy) until the batch
        has recorded its final status: a crash in between finalizes again from the same
        results, replacing this file under the same id."""
        tmp = self.dir / f".{file_id}.part"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:  # another file system, or links not supported
            shutil.copyfile(path, tmp)
        os.replace(tmp, self.dir / file_id)
        return self._write_meta(file_id, filename, "batch_output", path.stat().st_size, owner,
                                expires_after_s=expires_after_s)

    def get(self, file_id: str, owner: str | None = None) -> dict[str, Any]:
        """The file's record (its `FileObject` and `owner`); 404 for an unknown id and for
        another owner's file alike."""
        meta = read_json_record(self._meta_path(file_id))
        if meta is None or not visible_to(meta.get("owner"), owner) or self._expired(meta):
            raise self._not_found(file_id)
        return meta

    def _expired(self, meta: dict[str, Any]) -> bool:
        """Is the file past its `expires_at`? Such a file is deleted now: expiry is applied
        whenever a file is looked up or listed, and by `delete_expired`."""
        expires_at = meta.get("expires_at")
        if expires_at is None or time.time() < expires_at:
            return False
        self._meta_path(meta["id"]).unlink(missing_ok=True)
        (self.dir / meta["id"]).unlink(missing_ok=True)
        return True

    def delete_expired(self) -> int:
        """Delete every file past its `expires_at`, whoever owns it: the disk is given back
        even for files nobody looks up again. Returns how many were deleted."""
        records = (read_json_record(p) for p in self.dir.glob("file-*.json"))
        return sum(self._expired(meta) for meta in records if meta is not None)

    def _not_found(self, file_id: str) -> APIError:
        return APIError(404, f"no file with id {file_id!r}", param="file_id",
                        code="file_not_found")

    def content(self, file_id: str, owner: str | None = None) -> tuple[Path, dict[str, Any]]:
        """The file's bytes (a path) and its `FileObject`, from one read of the metadata; 404
        for an unknown id (the id is checked before it names a path)."""
        meta = self.get(file_id, owner)
        return self.dir / file_id, meta

    def open(self, file_id: str, owner: str | None = None) -> tuple[BinaryIO, dict[str, Any]]:
        """The file's bytes, opened, and its `FileObject`; 404 when it is unknown or deleted
        (by this replica or another) after its metadata was read. Once open, a delete no
        longer affects it: the handle reads the whole file."""
        path, meta = self.content(file_id, owner)
        try:
            return path.open("rb"), meta
        except FileNotFoundError:
            raise self._not_found(file_id) from None

    def content_path(self, file_id: str) -> Path:
        return self.content(file_id)[0]

    def list(self, purpose: str | None = None,
             owner: str | None = None) -> list[dict[str, Any]]:
        """Newest first, like OpenAI's default order; only those `owner` may see."""
        files = [read_json_record(p) for p in self.dir.glob("file-*.json")]
        # None: deleted (by another replica) between the listing and the read.
        files = [f for f in files if f is not None and visible_to(f.get("owner"), owner)
                 and (purpose is None or f["purpose"] == purpose) and not self._expired(f)]
        return sorted(files, key=list_key, reverse=True)

    def delete(self, file_id: str, owner: str | None = None) -> dict[str, Any]:
        self.get(file_id, owner)
        try:
            # The record first: of two deletes racing past the check above (replicas share
            # the folder), the one whose unlink takes it deleted the file; the other is a 404.
            self._meta_path(file_id).unlink()
        except FileNotFoundError:
            raise self._not_found(file_id) from None
        (self.dir / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def _meta_path(self, file_id: str) -> Path:
        return record_path(self.dir, file_id, "file-")

    def _write_meta(self, file_id: str, filename: str, purpose: str, size: int,
                    owner: str | None, created_at: int | None = None,
                    expires_after_s: int | None = None) -> dict[str, Any]:
        created_at = int(time.time()) if created_at is None else created_at
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None if expires_after_s is None else created_at + expires_after_s,
                "owner": owner}  # not shown to clients (owners.public)
        write_json_atomic(self._meta_path(file_id), meta)
        return meta


MAX_ID_CHARS = 64  # after the prefix; ours have 32 or 36 hex digits
_CLOCK_DIGITS, _ID_DIGITS = 16, 36  # an id from new_id: the clock's 16 hex digits, 20 random


def new_id(prefix: str) -> tuple[str, int]:
    """A new file or batch id and its `created_at`, both from one read of the clock. The id
    starts with the time in nanoseconds, so ids sort in creation order: `created_at` counts
    whole seconds, and objects made in one second used to list in the order of random ids.
    A list cursor whose object was deleted meanwhile still tells where it stood
    (`cursor_key`)."""
    ns = time.time_ns()
    return f"{prefix}{ns:0{_CLOCK_DIGITS}x}{uuid.uuid4().hex[:_ID_DIGITS - _CLOCK_DIGITS]}", \
        ns // 10**9


def list_key(record: dict[str, Any]) -> tuple[int, str]:
    """The order of listed files and batches (newest last)."""
    return record["created_at"], record["id"]


def cursor_key(obj_id: str, prefix: str) -> tuple[int, str] | None:
    """`list_key` of the object with this id, from the id alone (None for an id that does
    not tell: not one of `new_id`'s, such as a batch's result file or an older id)."""
    rest = obj_id[len(prefix):]
    if not (obj_id.startswith(prefix) and len(rest) == _ID_DIGITS and rest.isascii()
            and rest.isalnum()):
        return None
    try:
        return int(rest[:_CLOCK_DIGITS], 16) // 10**9, obj_id
    except ValueError:
        return None


def record_path(folder: Path, obj_id: str, prefix: str) -> Path:
    """`<folder>/<id>.json` for an id of ours (`prefix` + ASCII letters and digits); any other
    id names a path that never exists, so no id can reach outside the folder ("../"), nor
    name a file past the file system's 255-byte limit (an OSError, not a 404)."""
    rest = obj_id[len(prefix):]
    if not (obj_id.startswith(prefix) and rest.isascii() and rest.isalnum()
            and len(rest) <= MAX_ID_CHARS):
        return folder / f"{prefix}invalid.json.missing"
    return folder / f"{obj_id}.json"


def read_json_record(path: Path) -> dict[str, Any] | None:
    """A record (file metadata, batch), or None when there is none: records are replaced
    atomically, so a read either finds a whole one or none, but another replica may delete
    one between a listing and the read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)

