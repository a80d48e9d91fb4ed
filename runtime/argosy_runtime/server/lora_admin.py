"""Changing the served LoRA adapters while the server runs.

Two ways in, both applied through `LLMEngine.load_lora_adapter` / `unload_lora_adapter`:

- `--lora-modules-file`: the file is re-read every `POLL_SECONDS` (lora/modules_file.py);
- vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
  `POST /v1/unload_lora_adapter {"lora_name"}`, only with `--allow-runtime-lora-updates`
  (they make the server read folders a client names).

Loading runs on a new short-lived thread each time: a thread that runs torch ops keeps its own
OpenMP pool for as long as it lives (see cli/serve.py `_off_main_thread`), and a long-lived
pool beside the engine thread's slows every decode step. One lock orders all changes, so two
loads never race on the engine's name -> adapter map.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from argosy_runtime.background_tasks import running
from argosy_runtime.lora.modules_file import POLL_SECONDS
from argosy_runtime.server.errors import APIError

logger = logging.getLogger("argosy.server")
T = TypeVar("T")


async def on_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a new thread that ends with it; its result or exception, awaited."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting request was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # re-raised in the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="argosy-lora", daemon=True).start()
    return await future


class LoRAAdmin:
    """Serialized adapter changes for one engine (`LLMEngine`)."""

    def __init__(self, engine: Any, allow_http_updates: bool) -> None:
        self.engine = engine
        self.allow_http_updates = allow_http_updates
        self._lock = asyncio.Lock()
        self._changes: set[asyncio.Task[Any]] = set()  # in progress (a task needs a holder)

    def names(self) -> tuple[str, ...]:
        """Every adapter served (listed in /v1/models), loaded in memory or not."""
        return tuple(getattr(self.engine, "lora_paths", None) or ())

    def loaded_names(self) -> tuple[str, ...]:
        """The adapters in memory now (all of them without --max-loaded-loras)."""
        return tuple(getattr(self.engine, "lora_adapters", None) or ())

    def num_loads(self) -> int:
        """Adapters loaded by a request so far (--max-loaded-loras loads on first use)."""
        registry = getattr(self.engine, "lora_registry", None)
        return registry.num_loads if registry is not None else 0

    def _check_allowed(self) -> None:
        if not self.allow_http_updates:
            raise APIError(404, "runtime LoRA updates are off; start the server with "
                           "--allow-runtime-lora-updates", code="runtime_lora_updates_disabled")

    async def _in_turn(self, change: Callable[[], Awaitable[T]]) -> T:
        """`change()` under the lock, run to its end even when the request awaiting it is
        cancelled (its client went away mid-load): a loading thread cannot be stopped, and
        letting go of the lock before it ends would let the next change race it."""

        async def locked() -> T:
            async with self._lock:
                return await change()

        task = asyncio.ensure_future(locked())
        self._changes.add(task)
        # Nobody may await it any more: take its outcome so asyncio does not log it as lost.
        task.add_done_callback(lambda t: (self._changes.discard(t),
                                          t.cancelled() or t.exception()))
        return await asyncio.shield(task)

    async def load(self, name: str, path: str) -> str:
        self._check_allowed()

        async def load() -> None:
            if name in self.names():
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                               param="lora_name")
            try:
                await on_fresh_thread(self.engine.load_lora_adapter, name, path)
            except (ValueError, OSError) as exc:
                # The engine's messages about the name start with the field, as in
                # "lora_name: 'x' is not a usable adapter name"; the rest are the folder's.
                param = "lora_name" if str(exc).startswith("lora_name:") else "lora_path"
                raise APIError(400, str(exc), param=param) from exc

        await self._in_turn(load)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        self._check_allowed()
        async with self._lock:
            if name not in self.names():
                raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                               param="lora_name", code="model_not_found")
            self.engine.unload_lora_adapter(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @contextlib.asynccontextmanager
    async def watching_modules_file(self) -> AsyncIterator[None]:
        """While inside, apply `--lora-modules-file` every POLL_SECONDS (if the engine has one)."""
        modules_file = getattr(self.engine, "lora_modules_file", None)
        if modules_file is None:
            yield
            return

        async def poll() -> None:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                async with self._lock:
                    try:
                        await on_fresh_thread(modules_file.sync, self.engine)
                    except Exception:  # never stop watching over one bad round
                        logger.exception("LoRA modules file %s: sync failed", modules_file.path)

        async with running(poll(), name="LoRA modules file watcher"):
            yield
