"""`LoRARegistry`: the adapters a server serves (name -> path) and those loaded in memory now.

Without a cap (`max_loaded=None`) every registered adapter is loaded at registration, as
before. With `max_loaded=N` (`--max-loaded-loras`, vLLM's `--max-cpu-loras`) registering only
checks what it can without reading weights (`check_registrable`) and records the path; the
first request naming an adapter loads it (`acquire`), and loading one more than N first evicts
the least recently used loaded adapter that no request holds. Requests hold (pin) their
adapter from admission until they finish, so an adapter in use is never evicted; when all N
loaded adapters are held, `acquire(wait=True)` waits for one to be released.

Concurrent acquires of one adapter share one load: later callers wait for it and get its
adapter, or its error. A failed load leaves nothing behind, so a later acquire tries again.

Changes to one name take effect in the order they began: a `register` still loading when a
later `register` or `unregister` of that name completes is dropped when it finishes, a stale
load never overwrites a later change (`LLMEngine.load_lora_adapter` / `unload_lora_adapter`
may be called from any thread). Unregistering a name whose first registration is still
loading succeeds the same way: the name is not unknown, it is on its way in.

Thread-safe: one condition guards the state; weights are read outside it (a load takes
seconds for a large adapter, and other adapters' acquires and every release go on meanwhile).
`loaded` is replaced, never mutated, so a reader on another thread sees one map or the other.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from argosy_runtime.lora import hub, s3

if TYPE_CHECKING:
    from argosy_runtime.lora.adapter import LoRAAdapter

logger = logging.getLogger("argosy.lora")


def check_registrable(name: str, path: str, max_rank: int | None = None) -> None:
    """What can be checked without reading weights or the network (ValueError naming the
    adapter): hf:// and s3:// paths must parse; a folder must hold both PEFT files and an
    adapter_config.json this server supports (no DoRA, biases, modules_to_save, a rank
    above `max_rank`, ...). Shapes and module names are checked when the weights are loaded."""
    from argosy_runtime.lora.adapter import _check_supported, adapter_files, read_config

    try:
        if hub.is_hub_path(path):
            hub.parse_hub_path(path)
            return
        if s3.is_s3_path(path):
            s3.parse_s3_path(path)
            return
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {exc}") from exc
    config_path, _ = adapter_files(name, path, Path(path))
    _check_supported(name, read_config(name, config_path), max_rank)


class _Load:
    """One load in progress; the callers waiting on it read its outcome."""

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None


class LoRARegistry:
    def __init__(self, load: Callable[[str, str], LoRAAdapter], max_loaded: int | None,
                 max_rank: int | None = None) -> None:
        self._load = load  # (name, path) -> LoRAAdapter; raises ValueError / OSError
        self.max_loaded = max_loaded
        self.max_rank = max_rank  # --max-lora-rank, checked at lazy registration (load: too)
        self.paths: dict[str, str] = {}  # every registered adapter; replaced, never mutated
        self.loaded: dict[str, LoRAAdapter] = {}  # in memory now; replaced, never mutated
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest first
        self._pins: collections.Counter[str] = collections.Counter()  # holds per name
        self._loading: dict[str, _Load] = {}
        self._num_changes = 0  # register / unregister calls begun (their order)
        # name -> number of the change it reflects; kept only while the name is registered
        # or a register / load of it is in flight (`_prune`), so names come and go freely.
        self._in_force: dict[str, int] = {}
        self._registering: collections.Counter[str] = collections.Counter()  # in flight
        self._cond = threading.Condition()
        self.num_loads = 0  # loads that read weights (tests and logs)
        self.num_evictions = 0

    @property
    def is_lazy(self) -> bool:
        return self.max_loaded is not None

    # ---- registration -------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoRAAdapter | None:
        """Serve `path` as `name` (replacing a registration of that name). Eager: loads it
        now and returns it. Lazy: checks it (`check_registrable`) and returns None; a loaded
        copy of an older registration is dropped (requests holding it finish on it)."""
        with self._cond:
            change = self._begin_change()
            self._registering[name] += 1
        try:
            adapter = None
            if self.is_lazy:
                check_registrable(name, path, self.max_rank)
            else:
                adapter = self._load(name, path)
            with self._cond:
                if self._in_force.get(name, 0) > change:
                    logger.info("LoRA adapter %s: registration of %s superseded while it "
                                "loaded", name, path)
                    return adapter
                self._in_force[name] = change
                self.paths = {**self.paths, name: path}
                if not self.is_lazy:
                    self._set_loaded(name, adapter)
                else:
                    self._drop(name)
                    self._cond.notify_all()  # a slot may have come free
            return adapter
        finally:
            with self._cond:
                self._registering[name] -= 1
                if self._registering[name] <= 0:
                    del self._registering[name]
                self._prune(name)

    def unregister(self, name: str) -> None:
        """Stop serving `name`; requests holding it finish. KeyError if it is neither
        registered nor being registered: a first registration still loading (begun before
        this call) is superseded, as a re-registration is, so it never takes effect."""
        with self._cond:
            if name not in self.paths and not self._registering[name]:
                raise KeyError(name)
            self._in_force[name] = self._begin_change()
            self.paths = {k: v for k, v in self.paths.items() if k != name}
            self._drop(name)
            self._prune(name)
            self._cond.notify_all()

    # ---- holding adapters ---------------------------------------------------------------
    def acquire(self, name: str, count: int = 1, wait: bool = True,
                load: bool = True) -> LoRAAdapter | None:
        """`name`'s adapter, held `count` times (give each back with `release`), loading it
        on this thread if it is not loaded (sharing a load another thread has begun).

        None (nothing held) when it is not loaded and `load` is False, or when all
        `max_loaded` adapters are held and `wait` is False (else it waits for a release).
        ValueError for a name not registered or a failed load (the callers sharing that load
        all get it)."""
        with self._cond:
            while True:
                if name not in self.paths:
                    raise ValueError(f"lora_name: no LoRA adapter {name!r}; serving "
                                     f"{sorted(self.paths) or 'none'}")
                adapter = self.loaded.get(name)
                if adapter is not None:
                    self._pins[name] += count
                    self._lru.move_to_end(name)
                    return adapter
                if not load:
                    return None
                pending = self._loading.get(name)
                if pending is not None:  # another thread loads it: share its outcome
                    while not pending.done:
                        self._cond.wait()
                    if pending.error is not None:
                        raise pending.error
                    continue
                if self._make_room():
                    break
                if not wait:
                    return None
                self._cond.wait()
            pending = self._loading[name] = _Load()
            path = self.paths[name]
            registration = self._in_force.get(name, 0)
        try:
            adapter = self._load(name, path)
        except BaseException as exc:
            with self._cond:
                pending.done, pending.error = True, exc
                del self._loading[name]
                self._prune(name)
                self._cond.notify_all()
            logger.warning("LoRA adapter %s: load failed (retried by a later request): %s",
                           name, exc)
            raise
        with self._cond:
            pending.done = True
            del self._loading[name]
            self.num_loads += 1
            # Unregistered or re-registered meanwhile (the same path too: weights retrained
            # in place): this caller still gets what it asked for, but the registry keeps only
            # the current registration's adapter.
            if self._in_force.get(name, 0) == registration and self.paths.get(name) == path:
                self._set_loaded(name, adapter)
            self._prune(name)
            self._pins[name] += count
            self._cond.notify_all()
        logger.info("LoRA adapter %s loaded on demand (%d of at most %d loaded)", name,
                    len(self.loaded), self.max_loaded or 0)
        return adapter

    def release(self, name: str, count: int = 1) -> None:
        """Give back `count` holds of `name` taken by `acquire`."""
        with self._cond:
            left = self._pins[name] - count
            if left > 0:
                self._pins[name] = left
            else:
                self._pins.pop(name, None)
                self._cond.notify_all()

    def num_holds(self, name: str) -> int:
        return self._pins.get(name, 0)

    # ---- internals (under self._cond) ---------------------------------------------------
    def _begin_change(self) -> int:
        self._num_changes += 1
        return self._num_changes

    def _prune(self, name: str) -> None:
        """Forget `name`'s change number once nothing can compare against it: not registered,
        no register or load of it in flight (a later register starts from a higher number)."""
        if name not in self.paths and not self._registering[name] and name not in self._loading:
            self._in_force.pop(name, None)

    def _make_room(self) -> bool:
        """Room for one more load, evicting the least recently used unheld adapter if needed;
        False when every loaded (or loading) adapter is held."""
        if self.max_loaded is None or len(self.loaded) + len(self._loading) < self.max_loaded:
            return True
        for victim in self._lru:
            if self._pins.get(victim, 0) == 0:
                self._drop(victim)
                self.num_evictions += 1
                logger.info("LoRA adapter %s evicted (least recently used, no request holds it)",
                            victim)
                return True
        return False

    def _set_loaded(self, name: str, adapter: LoRAAdapter) -> None:
        self.loaded = {**self.loaded, name: adapter}
        self._lru[name] = None
        self._lru.move_to_end(name)

    def _drop(self, name: str) -> None:
        if name in self.loaded:
            self.loaded = {k: v for k, v in self.loaded.items() if k != name}
        self._lru.pop(name, None)
