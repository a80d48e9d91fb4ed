"""Tenants' `api_keys_file` re-read while the gateway runs (tenants/key_files.py), without
HTTP: files rewritten in place and swapped the way kubelet updates a mounted Secret, bad files
and keys claimed by two tenants keep the previous keys and are logged once, keys never
logged."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
from argosy_runtime.gateway.config import TenantConfig
from argosy_runtime.gateway.metrics import GatewayMetrics
from argosy_runtime.gateway.proxy.tenant_gate import TenantGate
from argosy_runtime.gateway.tenants.key_files import POLL_SECONDS, KeyFiles
from argosy_runtime.gateway.tenants.keys import KeyRing
from argosy_runtime.gateway.tenants.limiter import Lease

LOGGER = "argosy_runtime.gateway.tenants.key_files"


def bearer(key: str) -> str:
    return f"Bearer {key}"


def write(path: Path, *keys: str) -> None:
    path.write_text("".join(f"{k}\n" for k in keys))


def watched(*tenants: TenantConfig) -> tuple[KeyRing, KeyFiles]:
    ring = KeyRing(tenants)
    return ring, KeyFiles(tenants, ring)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_the_poll_is_a_few_seconds() -> None:
    assert 1 <= POLL_SECONDS <= 10


def test_a_rewritten_file_adds_and_removes_keys(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    path = tmp_path / "team-a"
    write(path, "sk-a-old", "sk-a-kept")
    ring, files = watched(TenantConfig(name="a", api_keys_file=str(path)),
                          TenantConfig(name="b", api_keys=("sk-b",)))
    assert files.sync() == []  # nothing changed: nothing applied, nothing logged
    assert not records(caplog, logging.INFO)
    write(path, "sk-a-kept", "sk-a-new1", "sk-a-new2")
    assert files.sync() == ["a"]
    assert ring.tenant_of(bearer("sk-a-new1")) == "a"
    assert ring.tenant_of(bearer("sk-a-new2")) == "a"
    assert ring.tenant_of(bearer("sk-a-kept")) == "a"
    assert ring.tenant_of(bearer("sk-a-old")) is None  # removed: a 401 from now on
    assert ring.tenant_of(bearer("sk-b")) == "b"  # other tenants untouched
    (info,) = records(caplog, logging.INFO)
    assert "'a'" in info and "3 keys now (was 2)" in info and str(path) in info
    assert "sk-" not in caplog.text
    # Only the order, spacing or a repeat changed: the same keys, nothing to apply.
    path.write_text("\n  sk-a-new2 \nsk-a-kept\nsk-a-new1\nsk-a-kept\n")
    assert files.sync() == []
    assert len(records(caplog, logging.INFO)) == 1


def kubelet_mount(folder: Path, files: dict[str, str], *, version: int) -> None:
    """Write `files` the way kubelet updates a Secret volume: into a new timestamped folder,
    then swap the `..data` symlink to it in one rename, then drop the old folder. The visible
    files are symlinks through `..data`, so their path never changes."""
    new = folder / f"..2024_06_01_12_00_0{version}.{version:09d}"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
        os.utime(new / name, (1_700_000_000, 1_700_000_000))  # every version: the same mtime
    data = folder / "..data"
    old = Path(os.readlink(data)) if data.is_symlink() else None
    os.symlink(new.name, folder / "..data_tmp")
    os.replace(folder / "..data_tmp", data)
    for name in files:
        if not (folder / name).is_symlink():
            os.symlink(f"..data/{name}", folder / name)
    if old is not None:
        for child in (folder / old).iterdir():
            child.unlink()
        (folder / old).rmdir()


def test_a_kubelet_symlink_swap_is_picked_up_even_with_the_same_mtime(tmp_path) -> None:
    mount = tmp_path / "argosy-tenants"
    mount.mkdir()
    kubelet_mount(mount, {"team-a": "sk-a-1\n", "team-b": "sk-b-1\n"}, version=1)
    ring, files = watched(TenantConfig(name="a", api_keys_file=str(mount / "team-a")),
                          TenantConfig(name="b", api_keys_file=str(mount / "team-b")))
    before = os.stat(mount / "team-a")
    # The Secret changes: a key moves from b to a, and b gets a new one, in one update.
    kubelet_mount(mount, {"team-a": "sk-a-1\nsk-b-1\n", "team-b": "sk-b-2\n"}, version=2)
    after = os.stat(mount / "team-a")
    assert after.st_mtime == before.st_mtime and after.st_size != before.st_size
    assert files.sync() == ["a", "b"]
    assert ring.tenant_of(bearer("sk-b-1")) == "a"  # moved in one sync, not refused
    assert ring.tenant_of(bearer("sk-b-2")) == "b"
    # Same size, same mtime, other content.
    kubelet_mount(mount, {"team-a": "sk-a-9\nsk-b-1\n", "team-b": "sk-b-2\n"}, version=3)
    assert files.sync() == ["a"]
    assert ring.tenant_of(bearer("sk-a-9")) == "a"
    assert ring.tenant_of(bearer("sk-a-1")) is None


@pytest.mark.parametrize("breakage", ["missing", "empty", "blank lines", "not utf-8",
                                      "a key with a space"])
def test_a_bad_file_keeps_the_previous_keys_warns_once_and_recovers(tmp_path, caplog,
                                                                     breakage: str) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    path = tmp_path / "team-a"
    write(path, "sk-a-1", "sk-a-2")
    ring, files = watched(TenantConfig(name="a", api_keys_file=str(path)))
    if breakage == "missing":
        path.unlink()
    elif breakage == "empty":
        path.write_text("")
    elif breakage == "blank lines":
        path.write_text("\n \n")
    elif breakage == "not utf-8":
        path.write_bytes(b"sk-\xff\xfe\n")
    else:
        path.write_text("sk-a-1\nsk-a half written\n")
    for _ in range(3):  # three polls: one warning
        assert files.sync() == []
        assert ring.tenant_of(bearer("sk-a-1")) == "a"
        assert ring.tenant_of(bearer("sk-a-2")) == "a"
    (warning,) = records(caplog, logging.WARNING)
    assert warning.startswith("tenants[a].api_keys_file: ")
    assert "keeps its previous 2 keys" in warning
    assert "sk-a" not in caplog.text
    write(path, "sk-a-2", "sk-a-3")  # valid again
    assert files.sync() == ["a"]
    assert ring.tenant_of(bearer("sk-a-3")) == "a"
    assert ring.tenant_of(bearer("sk-a-1")) is None
    assert len(records(caplog, logging.INFO)) == 1
    path.write_text("")  # broken a second time: warned again, once
    files.sync()
    files.sync()
    assert len(records(caplog, logging.WARNING)) == 2


def test_a_file_restored_unchanged_says_it_is_valid_again(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    path = tmp_path / "team-a"
    write(path, "sk-a-1")
    ring, files = watched(TenantConfig(name="a", api_keys_file=str(path)))
    path.write_text("")
    files.sync()
    write(path, "sk-a-1")
    assert files.sync() == []
    (info,) = records(caplog, logging.INFO)
    assert "valid again" in info and "1 key," in info
    files.sync()
    assert len(records(caplog, logging.INFO)) == 1


def test_a_key_of_two_tenants_is_refused_naming_both_tenants_not_the_key(tmp_path,
                                                                        caplog) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    path_b, path_c = tmp_path / "team-b", tmp_path / "team-c"
    write(path_b, "sk-b-1")
    write(path_c, "sk-c-1")
    ring, files = watched(TenantConfig(name="a", api_keys=("sk-a-inline",)),
                          TenantConfig(name="b", api_keys_file=str(path_b)),
                          TenantConfig(name="c", api_keys_file=str(path_c)))
    write(path_b, "sk-b-2", "sk-a-inline")  # a's key, still a's
    for _ in range(2):
        assert files.sync() == []
    assert ring.tenant_of(bearer("sk-a-inline")) == "a"
    assert ring.tenant_of(bearer("sk-b-1")) == "b"  # b keeps its previous keys...
    assert ring.tenant_of(bearer("sk-b-2")) is None  # ...and only those
    (warning,) = records(caplog, logging.WARNING)
    assert "a key of 'b' is also a key of 'a'" in warning and "sk-" not in warning
    # Two tenants gain the same new key at once: both are refused, the others still apply.
    write(path_b, "sk-b-1", "sk-shared")
    write(path_c, "sk-c-2", "sk-shared")
    assert files.sync() == []
    assert ring.tenant_of(bearer("sk-shared")) is None
    assert ring.tenant_of(bearer("sk-c-1")) == "c"
    warnings = records(caplog, logging.WARNING)
    assert any("a key of 'b' is also a key of 'c'" in w for w in warnings)
    assert any("a key of 'c' is also a key of 'b'" in w for w in warnings)
    write(path_c, "sk-c-2")  # resolved: both apply
    assert files.sync() == ["b", "c"]
    assert ring.tenant_of(bearer("sk-shared")) == "b"
    assert ring.tenant_of(bearer("sk-c-2")) == "c"
    assert "sk-" not in caplog.text


def test_a_refused_change_behind_an_unreadable_file_is_refused_too(tmp_path) -> None:
    # b's file breaks, so b keeps sk-b-1; c's new file claims sk-b-1: refused, not given to c.
    path_b, path_c = tmp_path / "team-b", tmp_path / "team-c"
    write(path_b, "sk-b-1")
    write(path_c, "sk-c-1")
    ring, files = watched(TenantConfig(name="b", api_keys_file=str(path_b)),
                          TenantConfig(name="c", api_keys_file=str(path_c)))
    path_b.write_text("")
    write(path_c, "sk-b-1")
    assert files.sync() == []
    assert ring.tenant_of(bearer("sk-b-1")) == "b"
    assert ring.tenant_of(bearer("sk-c-1")) == "c"


async def test_the_gate_reloads_on_its_poll_and_keeps_the_tenants_limiter(tmp_path) -> None:
    path = tmp_path / "team-a"
    write(path, "sk-a-1")
    gate = TenantGate([TenantConfig(name="a", api_keys_file=str(path), requests_per_minute=5)],
                      GatewayMetrics(list, list), keys_poll_s=0.02)
    limiter = gate.limiters["a"]
    assert isinstance(limiter.admit(), Lease)
    watch = asyncio.get_running_loop().create_task(gate.watch())
    try:
        write(path, "sk-a-2")
        for _ in range(200):
            if gate.keys.tenant_of(bearer("sk-a-2")) == "a":
                break
            await asyncio.sleep(0.01)
        assert gate.keys.tenant_of(bearer("sk-a-2")) == "a"
        assert gate.keys.tenant_of(bearer("sk-a-1")) is None
        # The same limiter, its bucket and in-flight count as they were.
        assert gate.limiters["a"] is limiter
        assert limiter.in_flight == 1 and limiter.requests is not None
        assert limiter.requests.level < 4.5  # a new bucket would be full (5)
    finally:
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
