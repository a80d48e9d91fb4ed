"""`LoRAAdmin` orders adapter changes: one at a time, each to its end, even when the request
that asked for one goes away mid-load (its loading thread cannot be stopped, so the next
change must wait for it). The engine here is a stand-in that records overlapping loads; the
real engine's loading is covered by test_lora_api.py and test_lora_admin_robustness.py."""

from __future__ import annotations

import asyncio
import threading
import time

from argosy_runtime.server.lora_admin import LoRAAdmin


class RecordingEngine:
    """`load_lora_adapter` as the engine's: slow, on the thread LoRAAdmin starts for it."""

    def __init__(self) -> None:
        self.lora_paths: dict[str, str] = {}
        self.release_first = threading.Event()
        self.loading: list[str] = []
        self.overlaps: list[tuple[str, ...]] = []

    def load_lora_adapter(self, name: str, path: str) -> None:
        self.loading.append(name)
        if len(self.loading) > 1:
            self.overlaps.append(tuple(self.loading))
        if len(self.lora_paths) == 0:  # the first load is slow
            self.release_first.wait(10)
        time.sleep(0.05)
        self.lora_paths[name] = path
        self.loading.remove(name)

    def unload_lora_adapter(self, name: str) -> None:
        self.overlaps.extend([("unload", *self.loading)] if self.loading else [])
        del self.lora_paths[name]


async def test_a_load_whose_client_left_still_holds_the_next_change_back() -> None:
    engine = RecordingEngine()
    admin = LoRAAdmin(engine, allow_http_updates=True)
    first = asyncio.create_task(admin.load("a", "/adapters/a"))
    await asyncio.sleep(0.2)
    assert engine.loading == ["a"]
    first.cancel()  # the client disconnected; its thread goes on loading "a"
    second = asyncio.create_task(admin.load("b", "/adapters/b"))
    await asyncio.sleep(0.3)
    assert engine.loading == ["a"] and not second.done()  # "b" waits its turn
    engine.release_first.set()
    assert "added successfully" in await second
    unloaded = await admin.unload("a")  # "a" was loaded all the same, and can be unloaded
    assert "removed successfully" in unloaded
    assert engine.overlaps == [] and engine.lora_paths == {"b": "/adapters/b"}
    assert first.cancelled()
