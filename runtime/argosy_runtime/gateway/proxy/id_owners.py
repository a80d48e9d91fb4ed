"""Which replica holds an object a replica created: Batch API files and batches, stored
Responses API responses. Each lives only on the replica that made it, so every later call on
its id must reach that replica.

Ids are remembered when the gateway sees them created (up to MAX_REMEMBERED_IDS, least
recently used first out); an id not remembered (made before a gateway restart, or through
another gateway instance) is looked for with `GET /v1/<kind>/<id>` on every replica in
rotation. The lookup carries the request's `X-Argosy-Owner` (with tenants), so another
tenant's id is found on no replica: the same 404 as an unknown id.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from argosy_runtime.gateway.proxy.errors import error_response
from argosy_runtime.gateway.proxy.headers import to_client, to_replica
from argosy_runtime.gateway.proxy.relay import BROKEN, CLIENT_CLOSED, UNEXPECTED, relay

if TYPE_CHECKING:
    from argosy_runtime.gateway.proxy.app import Gateway

logger = logging.getLogger(__name__)

MAX_REMEMBERED_IDS = 100_000


class IdOwners:
    def __init__(self, gateway: Gateway, max_ids: int = MAX_REMEMBERED_IDS) -> None:
        self.gateway = gateway
        self.max_ids = max_ids
        self._owners: OrderedDict[str, str] = OrderedDict()  # id -> replica URL

    def remember(self, obj_id: str, url: str) -> None:
        self._owners[obj_id] = url
        self._owners.move_to_end(obj_id)
        while len(self._owners) > self.max_ids:
            self._owners.popitem(last=False)

    def forget(self, obj_id: str) -> None:
        self._owners.pop(obj_id, None)

    async def owner(self, kind: str, obj_id: str,
                    headers: Mapping[str, str]) -> str | None | web.Response:
        """The URL of the replica in rotation holding `obj_id` (a `/v1/<kind>/<id>`), None
        when every replica in rotation says it does not know it, or the 503 to answer when
        none has it but some could not say (unreachable, timed out, a 5xx or 429): the id
        may well live there, and a 404 would tell the client it is gone for good (a client
        polling its batch gives up), where a 503 is retried."""
        try:
            obj_id.encode()
        except UnicodeEncodeError:
            # A lone surrogate ("\ud800" in a JSON body's id): not an id any replica made,
            # and not one a URL can carry (quoting it below raised, a 500).
            return None
        urls = self.gateway.catalog.replica_urls()
        known = self._owners.get(obj_id)
        if known in urls:
            return known
        session = self.session()
        timeout = aiohttp.ClientTimeout(total=self.gateway.config.health.timeout_s)
        forwarded = to_replica(headers)

        async def has(url: str) -> bool | None:
            """Whether the replica holds the id; None when it could not say."""
            try:
                # Quoted: the route decoded the id, so "..%2F..%2Fready" came as a path
                # that climbs out of /v1/{kind} unless it is encoded again.
                async with session.get(f"{url}/v1/{kind}/{quote(obj_id, safe='')}",
                                       headers=forwarded,
                                       timeout=timeout) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        return None
                    return resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return None

        answers = dict(zip(urls, await asyncio.gather(*(has(u) for u in urls)), strict=True))
        found = [u for u, ok in answers.items() if ok]
        if found:
            self.remember(obj_id, found[0])
            return found[0]
        unsure = [u for u, ok in answers.items() if ok is None]
        if unsure:
            # The replicas' addresses go to the log, not to the client.
            logger.warning("looking %s up: no answer from %s", obj_id, ", ".join(unsure))
            return error_response(
                503, f"could not look {obj_id!r} up on every replica ({len(unsure)} of "
                     f"{len(urls)} did not answer); retry later", headers={"Retry-After": "1"})
        return None

    async def call(self, request: web.Request, url: str, *, data: Any = None,
                   content_type: str | None = None, id_keys: Iterable[str] = ("id",),
                   stream: bool = False) -> web.StreamResponse:
        """Send the request to one replica and answer with its (small JSON) answer; the ids
        an answer holds under `id_keys` are remembered as living there. An event stream (a
        background response's, `GET /v1/responses/{id}?stream=true`), or any answer with
        `stream` (a file's content, which can be large), is relayed as it arrives instead.
        Counted in argosy:gateway_requests_total as generations are (relay.py)."""
        # The body is the gateway's own (JSON, or a re-encoded upload): so is its type.
        headers = to_replica(request.headers, content_type=False)
        if content_type:
            headers["Content-Type"] = content_type
        # A stream lasts as long as its generation, a large file's content as long as the
        # client takes to read it: no total timeout (the session's is 5 min).
        timeout = ({"timeout": aiohttp.ClientTimeout(
            total=None, sock_connect=self.gateway.config.connect_timeout_s)}
            if stream or "stream" in request.query else {})
        code = UNEXPECTED  # what it counts under; a gateway bug leaves this
        try:
            async with self.session().request(request.method, url + request.path_qs,
                                              data=data, headers=headers, **timeout) as resp:
                if stream or resp.content_type == "text/event-stream":
                    out = web.StreamResponse(status=resp.status, headers=to_client(resp.headers))
                    code = await relay(
                        request, out, resp, url,
                        idle_timeout_s=self.gateway.config.stream_idle_timeout_s)
                    return out
                body = await resp.read()
                status, relayed = resp.status, to_client(resp.headers)
                code = str(status)
        except (TimeoutError, aiohttp.ClientError) as exc:  # before any byte reached the client
            code = BROKEN
            return error_response(502, f"replica {url} failed: {exc!r}")
        except asyncio.CancelledError:
            code = CLIENT_CLOSED  # the client went away (handler cancelled)
            raise
        finally:
            self.gateway.count_by_id(url, code)
        if status == 200:
            try:
                answer = json.loads(body)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                for key in id_keys:
                    if isinstance(answer.get(key), str):
                        self.remember(answer[key], url)
        return web.Response(status=status, body=body, headers=relayed)

    def session(self) -> aiohttp.ClientSession:
        assert self.gateway.session is not None
        return self.gateway.session

