"""Tenants at their edges, through real HTTP in front of fake replicas: extreme limits, a
burst exactly at a limit, header forms and odd keys, keys files caught mid-write, and
reloads that must never stop the watcher nor lock anyone out."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from argosy_runtime.cli import gateway as cli
from argosy_runtime.gateway.config import GatewayConfig, TenantConfig
from fake_replica import FakeReplica
from test_gateway_tenants_proxy import BODY, auth, config, metric
from test_gateway_tenants_reload import Mount, args_for, gateway_yaml, until

KEY = "sk-robust-a"


async def post(s: aiohttp.ClientSession, url: str, headers: dict[str, str],
               body: dict | None = None) -> aiohttp.ClientResponse:
    async with s.post(f"{url}/v1/completions", json=body or BODY, headers=headers) as resp:
        await resp.read()
        return resp


async def test_a_burst_exactly_at_the_limit_is_admitted_and_one_more_is_not(
        fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    tenant = TenantConfig(name="a", api_keys=(KEY,), requests_per_minute=5, max_concurrent=5)
    gw, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        burst = await asyncio.gather(*(post(s, url, auth(KEY)) for _ in range(5)))
        assert [resp.status for resp in burst] == [200] * 5
        over = await post(s, url, auth(KEY))
        assert over.status == 429
        # Integer seconds, never 0: one request refills in 12 s.
        assert over.headers["Retry-After"].isdigit()
        assert 1 <= int(over.headers["Retry-After"]) <= 12
    assert gw.tenants.limiters["a"].in_flight == 0


async def test_retry_after_is_whole_positive_seconds_for_a_tokens_debt(fake_replicas,
                                                                       gateway) -> None:
    (r,) = await fake_replicas(1, prompt_tokens=1000)
    tenant = TenantConfig(name="a", api_keys=(KEY,), tokens_per_minute=60)
    _, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, auth(KEY))).status == 200  # 1004 tokens: ~944 in debt
        over = await post(s, url, auth(KEY))
        assert over.status == 429
        assert over.headers["Retry-After"].isdigit()
        assert 940 <= int(over.headers["Retry-After"]) <= 946


async def test_two_keys_of_one_tenant_share_its_limits(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    tenant = TenantConfig(name="a", api_keys=(KEY, "sk-robust-a2"), requests_per_minute=2)
    _, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, auth(KEY))).status == 200
        assert (await post(s, url, auth("sk-robust-a2"))).status == 200
        assert (await post(s, url, auth(KEY))).status == 429
        assert (await post(s, url, auth("sk-robust-a2"))).status == 429


async def test_no_spelling_of_a_path_reaches_a_replica_unlimited(fake_replicas, gateway) -> None:
    # The gate checks request.path, the router matches the same decoded path: a spelling is
    # either the admitted route (and limited) or no route at all (404).
    (r,) = await fake_replicas(1)
    tenant = TenantConfig(name="a", api_keys=(KEY,), requests_per_minute=1)
    _, url = await gateway(config([r.url], tenant))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, auth(KEY))).status == 200
    for target in ("/v1/completions", "/%761/completions", "/v1//completions",
                   "/v1/./completions", "/v1/completions/", "/v1/Completions",
                   "/v1/completions%20", "/x/../v1/completions"):
        assert await raw_status(url, f"Bearer {KEY}".encode(), target) in (404, 429), target
    assert len(r.requests) == 1


@pytest.mark.parametrize("limit", ["requests_per_minute", "tokens_per_minute", "max_concurrent"])
def test_a_huge_limit_is_a_config_error_naming_it(limit: str) -> None:
    # Beyond a float's range a bucket cannot hold it: refused like any bad field (a
    # ValueError naming it), not an OverflowError out of the limiter.
    with pytest.raises(ValueError, match=rf"tenants\[a\]\.{limit}"):
        GatewayConfig.from_dict({"tenants": [{"name": "a", "api_keys": [KEY],
                                              limit: 10**400}]})
    GatewayConfig.from_dict({"tenants": [{"name": "a", "api_keys": [KEY], limit: 10**15}]})


async def test_a_huge_limit_in_a_reloaded_file_is_refused_and_the_watcher_goes_on(
        fake_replicas, gateway, tmp_path) -> None:
    (r,) = await fake_replicas(1)
    mount = Mount(tmp_path / "argosy")
    mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY]}]))
    config_, config_file = cli.load(args_for(mount.path))
    gw, url = await gateway(config_, keys_poll_s=0.05, config_file=config_file)
    async with aiohttp.ClientSession() as s:
        mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY],
                                          "requests_per_minute": 10**400}]))
        await asyncio.sleep(0.3)
        assert (await post(s, url, auth(KEY))).status == 200  # still served as before
        # ...and the watcher still applies the next valid file.
        mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY],
                                          "requests_per_minute": 1}]))

        async def limited() -> bool:
            return gw.tenants.limiters["a"].requests is not None
        await until(limited)


async def test_a_round_that_fails_to_apply_does_not_end_the_watching(
        fake_replicas, gateway, tmp_path) -> None:
    # An unexpected error while applying a valid reloaded file (played by a routing applier
    # that raises once) used to end the watcher task: from then on a key removed from the
    # config stayed valid until a restart.
    (r,) = await fake_replicas(1)
    mount = Mount(tmp_path / "argosy")
    mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY, "sk-other"]}]))
    config_, config_file = cli.load(args_for(mount.path))
    gw, url = await gateway(config_, keys_poll_s=0.05, config_file=config_file)
    apply_config, calls = gw.tenants.apply_config, []

    def fails_once(config_: object) -> None:
        calls.append(config_)
        if len(calls) == 1:
            raise RuntimeError("a bug in applying routing")
        apply_config(config_)

    gw.tenants.apply_config = fails_once
    async with aiohttp.ClientSession() as s:
        mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY, "sk-other"],
                                          "requests_per_minute": 1000}]))

        async def tried() -> bool:
            return bool(calls)
        await until(tried)
        mount.write(gateway_yaml(r.url, [{"name": "a", "api_keys": [KEY]}]))  # revoke one

        async def revoked() -> bool:
            return (await post(s, url, auth("sk-other"))).status == 401
        await until(revoked)


@pytest.mark.parametrize("header", [
    f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}  ",
])
async def test_bearer_header_forms_that_name_the_key(fake_replicas, gateway, header) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys=(KEY,))))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, {"Authorization": header})).status == 200


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer"}, {"Authorization": "Bearer "}, {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY} extra"},
    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
    {"x-api-key": KEY}, {"api-key": KEY},
])
async def test_anything_else_is_a_401_never_a_500(fake_replicas, gateway, headers) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys=(KEY,))))
    async with aiohttp.ClientSession() as s:
        resp = await post(s, url, headers)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    assert not r.requests


async def raw_status(url: str, authorization: bytes, target: str = "/v1/completions") -> int:
    """The status of a completion sent to this exact request target, whose Authorization
    header is these exact bytes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"model": "tiny", "prompt": "hi"}'
    head = (f"POST {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode()
    writer.write(head + b"Authorization: " + authorization + b"\r\n\r\n" + body)
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


async def test_non_ascii_and_long_keys(fake_replicas, gateway, tmp_path) -> None:
    (r,) = await fake_replicas(1)
    keys = tmp_path / "keys"
    long_key = "sk-" + "x" * 4000
    keys.write_text("sk-ключ-é\n" + long_key + "\n", encoding="utf-8")
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys_file=str(keys))))
    async with aiohttp.ClientSession() as s:
        for key in ("sk-ключ-é", long_key):  # the client sends it as UTF-8
            assert (await post(s, url, auth(key))).status == 200
        assert (await post(s, url, auth("sk-ключ-e"))).status == 401
        # A key over aiohttp's header limit is refused before the gate, not a 500.
        assert (await post(s, url, auth("sk-" + "y" * 9000))).status in (400, 431)
    # The key's UTF-8 bytes work; the same key garbled (its UTF-8 read as Latin-1 and sent
    # again as UTF-8), and bytes that are not UTF-8 at all, are a 401.
    assert await raw_status(url, "Bearer sk-ключ-é".encode()) == 200
    garbled = "Bearer sk-ключ-é".encode().decode("latin-1").encode()
    assert await raw_status(url, garbled) == 401
    assert await raw_status(url, b"Bearer sk-\xe9\xff\xfe") == 401


async def test_a_keys_file_with_a_byte_order_mark(fake_replicas, gateway, tmp_path) -> None:
    # Editors on Windows save UTF-8 with a BOM; it is invisible, and not whitespace, so it
    # would silently become part of the first key.
    (r,) = await fake_replicas(1)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\r\nsk-second\r\n", encoding="utf-8-sig")
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys_file=str(keys))))
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, auth(KEY))).status == 200
        assert (await post(s, url, auth("sk-second"))).status == 200


async def test_a_keys_file_truncated_then_written_never_locks_anyone_out(
        fake_replicas, gateway, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, "argosy_runtime.gateway")
    (r,) = await fake_replicas(1)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    gw, url = await gateway(config([r.url], TenantConfig(name="a", api_keys_file=str(keys))),
                            keys_poll_s=0.02)
    async with aiohttp.ClientSession() as s:
        for content in ("", "\n", "   \n\n"):  # seen between the truncate and the write
            keys.write_text(content)
            await asyncio.sleep(0.1)
            assert (await post(s, url, auth(KEY))).status == 200
        keys.write_bytes(b"\xff\xfe garbage")  # not UTF-8: unreadable as keys
        await asyncio.sleep(0.1)
        assert (await post(s, url, auth(KEY))).status == 200
        keys.unlink()  # gone, then a folder in its place: cannot be read at all
        await asyncio.sleep(0.1)
        keys.mkdir()
        await asyncio.sleep(0.1)
        assert (await post(s, url, auth(KEY))).status == 200
        keys.rmdir()
        keys.write_text("sk-new\n")

        async def rotated() -> bool:
            return (await post(s, url, auth("sk-new"))).status == 200
        await until(rotated)
        assert (await post(s, url, auth(KEY))).status == 401
    assert KEY not in caplog.text


async def test_a_key_removed_while_its_request_streams_finishes_and_frees_the_slot(
        fake_replicas, gateway, tmp_path) -> None:
    (r,) = await fake_replicas(1, chunk_delay=0.1, num_chunks=5)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\nsk-other\n")
    tenant = TenantConfig(name="a", api_keys_file=str(keys), max_concurrent=1)
    gw, url = await gateway(config([r.url], tenant), keys_poll_s=0.02)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={**BODY, "stream": True},
                          headers=auth(KEY)) as resp:
            keys.write_text("sk-other\n")
            body = await resp.read()
            assert resp.status == 200 and body.rstrip().endswith(b"[DONE]")
        assert (await post(s, url, auth(KEY))).status == 401
        # The other key of the same tenant shares its limits, and the slot came back.
        assert (await post(s, url, auth("sk-other"))).status == 200
    assert gw.tenants.limiters["a"].in_flight == 0


async def test_many_disconnects_never_lock_a_tenant_out(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1, chunk_delay=0.05, num_chunks=20)
    tenant = TenantConfig(name="a", api_keys=(KEY,), max_concurrent=2)
    gw, url = await gateway(config([r.url], tenant))
    limiter = gw.tenants.limiters["a"]
    async with aiohttp.ClientSession() as s:
        for stream in (True, False) * 5:
            try:
                async with asyncio.timeout(0.08):
                    await post(s, url, auth(KEY), {**BODY, "stream": stream})
            except TimeoutError:
                pass
        for _ in range(100):
            if limiter.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert limiter.in_flight == 0
        assert (await post(s, url, auth(KEY))).status == 200


async def test_other_endpoints_need_a_key_and_probes_do_not(fake_replicas, gateway) -> None:
    (r,) = await fake_replicas(1)
    _, url = await gateway(config([r.url], TenantConfig(name="a", api_keys=(KEY,))))
    async with aiohttp.ClientSession() as s:
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny"),
                             ("POST", "/v1/embeddings"), ("POST", "/score"),
                             ("POST", "/rerank"), ("POST", "/v2/rerank"),
                             ("POST", "/classify"), ("POST", "/v1/files"),
                             ("GET", "/v1/files/file-x/content"),
                             ("DELETE", "/v1/responses/resp_x"), ("OPTIONS", "/v1/models")):
            async with s.request(method, f"{url}{path}", json={}) as resp:
                assert resp.status == 401, (method, path)
        for path in ("/health", "/ready", "/metrics"):
            async with s.get(f"{url}{path}") as resp:
                assert resp.status == 200, path
    assert not r.requests


class ThinkingReplica(FakeReplica):
    """Streams a chat answer as the runtime with `--reasoning-parser` does: the thinking in
    `reasoning_content` deltas (no `content`), then the answer."""

    async def _stream(self, request: web.Request, body: dict[str, Any],
                      is_chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.num_chunks):
            field = "reasoning_content" if i < self.num_chunks - 1 else "content"
            event = {"id": "x", "model": self.model, "choices": [
                {"index": 0, "delta": {field: self.text_of(i)}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_a_streamed_reasoning_models_thinking_is_charged(gateway) -> None:
    # Without include_usage a stream is charged one token per chunk relayed: the thinking
    # chunks are generated tokens too (most of a reasoning model's answer).
    replica = ThinkingReplica(model="tiny", num_chunks=10)
    await replica.start()
    try:
        _, url = await gateway(config([replica.url], TenantConfig(name="a", api_keys=(KEY,))))
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "why?"}],
                "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json=chat, headers=auth(KEY)) as resp:
                assert resp.status == 200
                await resp.read()
            assert await metric(s, url, "argosy:gateway_tenant_tokens_total", tenant="a",
                                kind="completion") == 10
    finally:
        await replica.stop()
