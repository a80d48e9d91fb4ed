"""The Batch API through the gateway (`/v1/files`, `/v1/batches`, see docs/batch.md).

A replica keeps the files and batches it created (in its `--batch-dir`), so each call must
reach the replica that holds its id:

- `POST /v1/files` goes to the least-loaded replica of the model the file's first request
  names (a batch runs where its input file is). The upload is read as a stream into a
  temporary file, so it is bounded by a replica's file limit (MAX_FILE_BYTES), not by the
  gateway's request body limit; a larger one is refused here with the replica's 413;
- `POST /v1/batches` goes to the replica holding `input_file_id`;
- calls on one id (`/v1/files/{id}[/content]`, `/v1/batches/{id}[/cancel]`) go to the replica
  that answered for the id before, else to the one of the replicas in rotation that knows it
  (`id_owners.py`, shared with the Responses API);
- `GET /v1/files` and `GET /v1/batches` merge every replica's list, newest first, each id
  once (replicas sharing a `--batch-dir` all list the same ones).

With tenants, every call here (lists and id lookups included) carries the tenant as
`X-Argosy-Owner` (tenant_gate.py), so the replicas themselves list only the tenant's files
and batches and answer 404 for another tenant's ids (server/owners.py).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from typing import IO, TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from argosy_runtime.gateway.policies import LeastLoadPolicy, RouteRequest
from argosy_runtime.gateway.proxy.errors import (
    MALFORMED_JSON,
    bad_request,
    error_response,
    malformed_json,
    model_not_found,
    no_replica,
)
from argosy_runtime.gateway.proxy.headers import to_replica
from argosy_runtime.server.batch.file_store import MAX_FILE_BYTES, file_too_large
from argosy_runtime.server.batch.pagination import page

if TYPE_CHECKING:
    from argosy_runtime.gateway.proxy.app import Gateway

MAX_FIELD_BYTES = 64 * 1024  # an upload's form field other than the file (`purpose`)
MAX_FIELDS = 16  # form fields passed on beside the file; OpenAI's upload has three
SPOOL_WRITE_BYTES = 1 << 20  # an upload reaches its temporary file in writes this large
LIST_LIMIT = {"files": 10_000, "batches": 100}  # the most a replica's list page holds


class BatchRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._least_load = LeastLoadPolicy(gateway.routing.config)  # where uploads go

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload_file)
        app.router.add_get("/v1/files", self.list_all)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_all)
        for path in ("/v1/files/{id}", "/v1/files/{id}/content", "/v1/batches/{id}",
                     "/v1/batches/{id}/cancel"):
            app.router.add_route("*", path, self.by_id)

    def _uploads_policy(self) -> LeastLoadPolicy:
        """Least-load with the routing settings in force (its weights follow a reload)."""
        routing = self.gateway.routing.config
        if self._least_load.routing is not routing:
            policy = LeastLoadPolicy(routing)
            policy.adopt(self._least_load)
            self._least_load = policy
        return self._least_load

    # -- creating ----------------------------------------------------------------------------
    async def upload_file(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "multipart/form-data":
            return bad_request("expected a multipart/form-data upload with a 'file' and a "
                               "'purpose' field")
        with tempfile.TemporaryFile() as spool:
            try:
                upload = await _read_upload(request, spool, MAX_FILE_BYTES)
            except _TooLarge as exc:
                # No need to read the rest: after the answer, aiohttp reads and drops what the
                # client still sends for a bounded time (lingering close), so it sees the 413,
                # not a reset connection.
                return error_response(413, str(exc), param=exc.param, code=exc.code)
            except (ValueError, AssertionError) as exc:
                return bad_request(f"malformed multipart/form-data upload: {exc}")
            if isinstance(upload, web.Response):
                return upload
            filename, content_type, fields = upload
            model = await asyncio.to_thread(_first_model, spool)
            pool = await self._pool_for(model)
            if isinstance(pool, web.Response):
                return pool
            replica = self._uploads_policy().choose(self.gateway.pools[pool].available(),
                                                    RouteRequest())
            if replica is None:  # counted as a generation's refusal is (Gateway._send)
                self.gateway.count(pool, "", "503")
                return no_replica(pool)
            spool.seek(0)
            data = aiohttp.FormData()
            for name, value in fields.items():  # purpose, expires_after[...]: as sent
                data.add_field(name, value)
            data.add_field("file", spool, filename=filename, content_type=content_type)
            return await self._call(request, replica.url, data=data)

    async def create_batch(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except MALFORMED_JSON as exc:
            return malformed_json(exc)
        file_id = body.get("input_file_id") if isinstance(body, dict) else None
        if not isinstance(file_id, str):
            return bad_request("input_file_id: a file id is required", param="input_file_id")
        owner = await self.gateway.id_owners.owner("files", file_id, request.headers)
        if owner is None:
            return _not_found("file", file_id)
        if isinstance(owner, web.Response):
            return owner
        return await self._call(request, owner, data=json.dumps(body).encode(),
                                content_type="application/json")

    # -- one id ------------------------------------------------------------------------------
    async def by_id(self, request: web.Request) -> web.StreamResponse:
        kind = request.path.split("/")[2]  # "files" or "batches"
        owner = await self.gateway.id_owners.owner(kind, request.match_info["id"], request.headers)
        if owner is None:
            return _not_found("batch" if kind == "batches" else "file",
                              request.match_info["id"])
        if isinstance(owner, web.Response):
            return owner
        if request.path.endswith("/content"):  # relayed as it arrives (output files can be large)
            return await self.gateway.id_owners.call(request, owner, stream=True)
        return await self._call(request, owner, data=await request.read() or None,
                                content_type=request.headers.get("Content-Type"))

    # -- lists -------------------------------------------------------------------------------
    async def list_all(self, request: web.Request) -> web.StreamResponse:
        kind = request.path.rsplit("/", 1)[1]
        query = {"limit": str(LIST_LIMIT[kind])}
        if kind == "files" and "purpose" in request.query:
            query["purpose"] = request.query["purpose"]
        try:
            limit = int(request.query.get("limit", 10_000 if kind == "files" else 20))
        except ValueError:
            return bad_request("limit must be an integer", param="limit")
        session = self._session()
        # As the other id lookups: a replica that does not answer in time (its --batch-dir
        # on a stalled network file system) is left out, not waited for the session's 5 min.
        timeout = aiohttp.ClientTimeout(total=self.gateway.config.health.timeout_s)

        async def fetch(url: str) -> tuple[int, Any]:
            try:
                async with session.get(f"{url}/v1/{kind}", params=query, timeout=timeout,
                                       headers=to_replica(request.headers)) as resp:
                    return resp.status, await resp.json(content_type=None)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                return 502, None

        answers = await asyncio.gather(*(fetch(u) for u in self.gateway.catalog.replica_urls()))
        refused = [(s, b) for s, b in answers if s != 200 and isinstance(b, dict)]
        if refused and not any(s == 200 for s, _ in answers):
            return web.json_response(refused[0][1], status=refused[0][0])  # e.g. a 401
        # Replicas sharing one --batch-dir all list the same ids: each id once. An answer
        # that is not a list object, or items without an id (not a runtime replica), lists
        # nothing: one odd replica must not make the merged list a 500.
        unique = {item["id"]: item for s, b in answers if s == 200 and isinstance(b, dict)
                  and isinstance(b.get("data"), list)
                  for item in b["data"] if isinstance(item, dict) and isinstance(item.get("id"), str)}
        items = list(unique.values())
        items.sort(key=lambda item: (item.get("created_at", 0), item["id"]), reverse=True)
        if request.query.get("order") == "asc":
            items.reverse()
        return web.json_response(page(items, request.query.get("after"), max(1, limit)))

    # -- plumbing ----------------------------------------------------------------------------
    async def _pool_for(self, model: str | None) -> str | web.Response:
        gateway = self.gateway
        if model is None and len(gateway.pools) == 1:
            return next(iter(gateway.pools))
        if model is None:
            return bad_request("the file's first request names no model: the gateway routes a "
                               "batch to a replica of that model", param="file")
        if model in gateway.pools:
            return model
        parent = await gateway.catalog.adapter_parent(model)
        if parent is not None:
            return parent
        return model_not_found(model, list(gateway.pools))

    async def _call(self, request: web.Request, url: str, *, data: Any = None,
                    content_type: str | None = None) -> web.StreamResponse:
        """One replica's (small JSON) answer; the file and batch ids it holds are remembered
        as living there."""
        return await self.gateway.id_owners.call(
            request, url, data=data, content_type=content_type,
            id_keys=("id", "output_file_id", "error_file_id"))

    def _session(self) -> aiohttp.ClientSession:
        return self.gateway.id_owners.session()


class _TooLarge(Exception):
    """An upload's file (or another form field) over its limit: a 413."""

    def __init__(self, param: str, limit: int) -> None:
        if param == "file":
            super().__init__(file_too_large(limit))
            self.code: str | None = "file_too_large"
        else:
            super().__init__(f"form field {param!r} is larger than {limit} bytes")
            self.code = None
        self.param = param


async def _read_upload(request: web.Request, spool: IO[bytes], limit: int
                       ) -> tuple[str, str, dict[str, str]] | web.Response:
    """Stream a multipart upload's `file` into `spool` (raising _TooLarge past `limit` bytes)
    and read its other fields (`purpose`, `expires_after[anchor]`, ...: the replica checks
    them); returns (filename, content type, fields), or the 400 to answer."""
    reader = await request.multipart()
    filename = content_type = None
    fields: dict[str, str] = {}
    while (part := await reader.next()) is not None:
        if not isinstance(part, aiohttp.BodyPartReader):
            raise ValueError("nested multipart parts are not accepted")
        if part.name == "file" and part.filename and filename is None:
            filename = part.filename
            content_type = part.headers.get("Content-Type", "application/octet-stream")
            await _copy_part(part, spool, limit)
        elif part.name and part.name != "file" and len(fields) < MAX_FIELDS:
            raw = bytearray()
            while chunk := await part.read_chunk():
                raw.extend(chunk)
                if len(raw) > MAX_FIELD_BYTES:
                    raise _TooLarge(part.name, MAX_FIELD_BYTES)
            fields[part.name] = raw.decode(part.get_charset(default="utf-8"), errors="replace")
        else:
            await _copy_part(part, None, MAX_FIELD_BYTES)  # skipped (bounded)
    if filename is None or content_type is None or "purpose" not in fields:
        return bad_request("a multipart upload needs a 'file' and a 'purpose' field")
    return filename, content_type, fields


async def _copy_part(part: aiohttp.BodyPartReader, out: IO[bytes] | None, limit: int) -> None:
    size = 0
    pending = bytearray()
    while chunk := await part.read_chunk():
        data = part.decode(chunk)  # a Content-Transfer-Encoding, if a client still sends one
        size += len(data)
        if size > limit:
            raise _TooLarge("file" if out is not None else str(part.name), limit)
        if out is not None:
            pending.extend(data)
            if len(pending) >= SPOOL_WRITE_BYTES:
                await asyncio.to_thread(out.write, bytes(pending))
                pending.clear()
    if out is not None and pending:
        await asyncio.to_thread(out.write, bytes(pending))


def _first_model(upload: IO[bytes]) -> str | None:
    """The `model` of the file's first request (None when it has none or is not JSONL: the
    replica then reports the problem when the batch is created)."""
    upload.seek(0)
    for raw in upload:
        if raw.strip():
            try:
                model = json.loads(raw).get("body", {}).get("model")
            except (ValueError, AttributeError, RecursionError):  # nested too deep: a client's
                return None  # mistake, which the replica reports when the batch is created
            return model if isinstance(model, str) else None
    return None


def _not_found(kind: str, obj_id: str) -> web.Response:
    return error_response(404, f"no {kind} with id {obj_id!r} on any replica in rotation",
                          code=f"{kind}_not_found")
