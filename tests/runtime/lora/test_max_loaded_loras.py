"""`max_loaded_loras` (vLLM's --max-cpu-loras): adapters are registered cheaply, loaded by their
first request, and at most N stay in memory, the least recently used one no request holds
evicted first. Outputs equal the eager path's, also after an eviction and a reload."""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.lora import registry as registry_module
from argosy_runtime.lora.registry import LoRARegistry

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks  # noqa: E402
from test_lora_engine import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    _patch_config,
    _reshape_a,
    adapters,  # noqa: F401  (fixtures)
    model_dir,  # noqa: F401
    references,  # noqa: F401
    run,
)

# ---- the registry alone, with a stand-in loader -----------------------------------------------


class Loader:
    """Counts loads; `delay` slows each one, `fail` names adapters whose next load fails."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[str] = []
        self.fail: set[str] = set()

    def __call__(self, name: str, path: str) -> SimpleNamespace:
        self.calls.append(name)
        time.sleep(self.delay)
        if name in self.fail:
            self.fail.discard(name)
            raise ValueError(f"LoRA adapter {name!r}: cannot download (test)")
        return SimpleNamespace(name=name, path=path)


def registry(max_loaded: int | None, loader: Loader, names: str = "abc") -> LoRARegistry:
    reg = LoRARegistry(loader, max_loaded)
    for name in names:
        reg.register(name, f"hf://org/{name}")  # checked without the network
    return reg


def use(reg: LoRARegistry, name: str) -> None:
    """One request on `name` that runs and finishes."""
    reg.acquire(name)
    reg.release(name)


def test_registering_loads_nothing_and_the_first_use_loads() -> None:
    loader = Loader()
    reg = registry(2, loader)
    assert set(reg.paths) == {"a", "b", "c"} and reg.loaded == {} and loader.calls == []
    assert reg.acquire("a", load=False, wait=False) is None  # not loaded: nothing held
    assert reg.acquire("a").name == "a" and loader.calls == ["a"]
    assert reg.acquire("a") is reg.loaded["a"] and loader.calls == ["a"]  # loaded once
    assert reg.num_holds("a") == 2
    with pytest.raises(ValueError, match="no LoRA adapter 'zz'"):
        reg.acquire("zz")
    # Eager (no cap): every registration loads at once, as before.
    eager = registry(None, Loader())
    assert set(eager.loaded) == {"a", "b", "c"}


def test_the_least_recently_used_adapter_is_evicted() -> None:
    loader = Loader()
    reg = registry(2, loader)
    use(reg, "a")
    use(reg, "b")
    use(reg, "a")  # b is now the least recently used
    use(reg, "c")
    assert set(reg.loaded) == {"a", "c"} and reg.num_evictions == 1
    use(reg, "b")  # evicts a (c was used after it)
    assert set(reg.loaded) == {"b", "c"} and loader.calls == ["a", "b", "c", "b"]


def test_held_adapters_are_not_evicted_and_a_new_one_waits_for_a_release() -> None:
    loader = Loader()
    reg = registry(2, loader)
    reg.acquire("a")
    reg.acquire("b")
    assert reg.acquire("c", wait=False) is None and set(reg.loaded) == {"a", "b"}
    got = []
    waiter = threading.Thread(target=lambda: got.append(reg.acquire("c")))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and set(reg.loaded) == {"a", "b"}  # still waiting
    reg.release("b")
    waiter.join(5)
    assert got and got[0].name == "c" and set(reg.loaded) == {"a", "c"}  # b went, a held


def test_concurrent_first_uses_share_one_load() -> None:
    loader = Loader(delay=0.3)
    reg = registry(2, loader)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(reg.acquire("a"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert loader.calls == ["a"] and len(got) == 8 and all(g is got[0] for g in got)
    assert reg.num_holds("a") == 8


def test_a_failed_load_fails_everyone_waiting_on_it_and_is_retried_later() -> None:
    loader = Loader(delay=0.3)
    loader.fail.add("a")
    reg = registry(2, loader)
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            reg.acquire("a")
        except ValueError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert loader.calls == ["a"] and len(errors) == 4
    assert all("cannot download" in str(e) for e in errors)
    assert reg.loaded == {} and reg.num_holds("a") == 0
    use(reg, "b")  # the others are unaffected
    assert reg.acquire("a").name == "a" and loader.calls == ["a", "b", "a"]  # retried


def test_unregistering_and_reregistering() -> None:
    loader = Loader()
    reg = registry(2, loader)
    use(reg, "a")
    reg.register("a", "hf://org/a2")  # a new path: the loaded copy goes
    assert reg.loaded == {} and reg.acquire("a").path == "hf://org/a2"
    reg.unregister("a")
    assert "a" not in reg.paths and reg.loaded == {}
    with pytest.raises(KeyError):
        reg.unregister("a")


# ---- the engine, with tiny real adapters -------------------------------------------------------


def test_engine_loads_on_first_use_evicts_and_outputs_equal_eager(model_dir, adapters,  # noqa: F811
                                                                  references) -> None:  # noqa: F811
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4, max_loaded_loras=1,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    reg = engine.lora_registry
    assert set(engine.lora_paths) == {"all", "attn-rs"} and engine.lora_adapters == {}
    assert run(engine, [("all", 0)]) == [references["all"][0]]
    assert set(engine.lora_adapters) == {"all"}
    assert run(engine, [("attn-rs", 0), (None, 0)]) == [references["attn-rs"][0],
                                                       references[None][0]]
    assert set(engine.lora_adapters) == {"attn-rs"} and reg.num_evictions == 1
    # Reloaded: same tokens, and its prefix-cache blocks (salted by the files' content) are
    # found again: 8 full blocks of the 36-token prompt.
    hits_before = engine.get_stats().prefix_cache_hits
    assert run(engine, [("all", 0)]) == [references["all"][0]]
    assert engine.get_stats().prefix_cache_hits - hits_before == 32
    assert reg.num_loads == 3 and reg.num_evictions == 2
    assert reg.num_holds("all") == reg.num_holds("attn-rs") == 0
    assert_no_leaks(engine)


def test_engine_request_waits_while_every_loaded_adapter_is_in_use(model_dir, adapters,  # noqa: F811
                                                                   references) -> None:  # noqa: F811
    """max_loaded_loras=1: requests on the second adapter wait (not fail) until the first
    adapter's requests finish; never two adapters in memory."""
    engine = LLMEngine(model=str(model_dir), dtype="float32", max_loaded_loras=1,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=2)
    engine.add_request("a", PROMPTS[1], params, lora_name="all")
    engine.add_request("b", PROMPTS[1], params, lora_name="attn-rs")
    engine.add_request("base", PROMPTS[1], params)
    assert engine.lora_registry.num_holds("all") == 2  # one per sequence
    done, loaded_seen = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
        assert len(engine.lora_adapters) <= 1
        loaded_seen.add(tuple(engine.lora_adapters))
    assert done == {"a": [references["all"][1]] * 2, "b": [references["attn-rs"][1]] * 2,
                    "base": [references[None][1]] * 2}
    assert loaded_seen == {("all",), ("attn-rs",)}
    assert_no_leaks(engine)


def test_engine_abort_of_a_waiting_request_frees_nothing_it_did_not_hold(model_dir,  # noqa: F811
                                                                          adapters) -> None:  # noqa: F811
    engine = LLMEngine(model=str(model_dir), dtype="float32", max_loaded_loras=1,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("a", PROMPTS[1], params, lora_name="all")
    engine.add_request("b", PROMPTS[1], params, lora_name="attn-rs")  # waits for a slot
    engine.abort_request(["b", "a"])
    assert not engine.has_unfinished_requests()
    assert engine.lora_registry.num_holds("all") == 0
    assert run(engine, [("attn-rs", 1)])  # the slot is free again
    assert_no_leaks(engine)


def test_engine_adapter_that_fails_to_load_errors_and_is_retried(model_dir, adapters,  # noqa: F811
                                                                 references, tmp_path) -> None:  # noqa: F811
    folder = tmp_path / "bad"
    shutil.copytree(adapters["all"], folder)
    _reshape_a(folder)  # fine config (registers), weights that do not fit the model
    engine = LLMEngine(model=str(model_dir), dtype="float32", max_loaded_loras=1,
                       lora_modules={"bad": str(folder), "all": str(adapters["all"])})
    assert "bad" in engine.lora_paths
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="LoRA adapter 'bad': layer .* has shapes"):
        engine.add_request("x", PROMPTS[1], params, lora_name="bad")
    assert run(engine, [("all", 1)]) == [references["all"][1]]  # the others still serve
    shutil.rmtree(folder)
    shutil.copytree(adapters["attn-rs"], folder)  # fixed: the next request loads it
    assert run(engine, [("bad", 1)]) == [references["attn-rs"][1]]
    assert_no_leaks(engine)


def test_registration_checks_what_it_can_without_weights(model_dir, adapters,  # noqa: F811
                                                         tmp_path) -> None:
    engine = LLMEngine(model=str(model_dir), dtype="float32", max_loaded_loras=2)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["all"], dora)
    _patch_config(dora, use_dora=True)
    for path, message in [(tmp_path / "missing", "needs adapter_config.json"),
                          (dora, "unsupported .*use_dora"),
                          ("hf://not-a-repo", "expected hf://org/name"),
                          ("s3://", "expected s3://bucket/prefix")]:
        with pytest.raises(ValueError, match=message):
            engine.load_lora_adapter("x", str(path))
    with pytest.raises(ValueError, match="not a usable adapter name"):
        engine.load_lora_adapter(engine.served_model_name, str(adapters["all"]))
    assert engine.lora_paths == {}
    engine.load_lora_adapter("remote", "hf://org/adapter")  # no network until first use
    assert set(engine.lora_paths) == {"remote"} and engine.lora_adapters == {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_loaded_loras": 0}, "max_loaded_loras .* must be an integer >= 1"),
    ({"max_loaded_loras": "2"}, "max_loaded_loras .* must be an integer >= 1"),
    ({"max_loaded_loras": 2, "max_loras": 3}, "max_loras .* must be <= max_loaded_loras"),
])
def test_max_loaded_loras_is_validated(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
    with pytest.raises(ValueError, match=message):
        LLMEngine(model="/no/such/model", **kwargs)  # before the model loads


def test_cli_flag_and_vllm_alias() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for flag in ("--max-loaded-loras", "--max-cpu-loras"):
        args = EngineArgs.from_cli_args(parser.parse_args([flag, "4", "--max-loras", "2"]))
        assert args.max_loaded_loras == 4 and args.max_loras == 2
    assert EngineArgs.from_cli_args(parser.parse_args([])).max_loaded_loras is None


class GatedLoader(Loader):
    """A load of a path in `gates` waits until its event is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}
        self.entered = threading.Event()  # a gated load has begun

    def __call__(self, name: str, path: str) -> SimpleNamespace:
        if path in self.gates:
            self.entered.set()
            self.gates[path].wait(10)
        return super().__call__(name, path)


@pytest.mark.parametrize("then", ["register", "unregister"])
def test_a_registration_still_loading_never_overwrites_a_later_change(then: str) -> None:
    """The server's admin lock goes when the HTTP request loading an adapter is cancelled,
    while the load goes on on its thread: the client's retry with another path (or an unload)
    completes first, and the stale load must not replace it when it finishes."""
    loader = GatedLoader()
    reg = LoRARegistry(loader, None)  # eager: register reads the weights
    reg.register("a", "/old")
    loader.gates["/slow"] = threading.Event()
    stale = threading.Thread(target=reg.register, args=("a", "/slow"))
    stale.start()
    assert loader.entered.wait(10)  # the stale register is inside its load
    if then == "register":
        reg.register("a", "/retry")
    else:
        reg.unregister("a")
    loader.gates["/slow"].set()
    stale.join(10)
    if then == "register":
        assert reg.paths == {"a": "/retry"} and reg.loaded["a"].path == "/retry"
    else:
        assert reg.paths == {} and reg.loaded == {}
    reg.register("a", "/next")  # later changes still apply
    assert reg.paths == {"a": "/next"} and reg.loaded["a"].path == "/next"


def test_a_load_begun_before_a_reregistration_of_the_same_path_is_not_kept() -> None:
    """Weights retrained in place: unload and load again under the same path while a
    request's on-demand load of the old weights is still reading them. That request gets
    what it asked for; the registry does not keep it, so the next request loads afresh."""
    loader = GatedLoader()
    reg = LoRARegistry(loader, 2)  # lazy: acquire loads on first use
    reg.register("a", "hf://org/a")
    loader.gates["hf://org/a"] = threading.Event()
    old = threading.Thread(target=reg.acquire, args=("a",))
    old.start()
    assert loader.entered.wait(10)  # the request's load is reading the old weights
    reg.unregister("a")
    reg.register("a", "hf://org/a")
    loader.gates["hf://org/a"].set()
    old.join(10)
    reg.release("a")
    assert "a" not in reg.loaded
    reg.acquire("a")
    assert loader.calls == ["a", "a"]


@pytest.mark.parametrize("max_loaded", [None, 2])
def test_many_load_unload_cycles_keep_no_state_per_name(max_loaded: int | None) -> None:
    """A platform registering and dropping adapters under fresh names for weeks: nothing
    stays behind per name once it is unregistered (the change numbers did, one per name
    ever seen), whether or not a request loaded it or a load failed."""
    loader = Loader()
    reg = LoRARegistry(loader, max_loaded)
    for i in range(200):
        name = f"tenant-{i}"
        if i % 3 == 0:
            loader.fail.add(name)
            with pytest.raises(ValueError):  # eager: the register's load fails
                reg.register(name, f"hf://org/{name}")
                use(reg, name)  # lazy: the first request's load fails
        else:
            reg.register(name, f"hf://org/{name}")
            use(reg, name)
        if name in reg.paths:
            reg.unregister(name)
    assert reg.paths == {} and reg.loaded == {} and not reg._pins and not reg._loading
    assert reg._in_force == {}  # one entry per name ever registered before the fix
    reg.register("a", "hf://org/a")  # and names still work afterwards
    assert reg.acquire("a").path == "hf://org/a"


@pytest.mark.parametrize("max_loaded", [None, 2])
def test_unloading_a_name_whose_first_registration_is_still_loading(
        max_loaded: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`unload` called (another thread, e.g. LLM users' admin code) while the name's first
    `load` is still in flight: it succeeds and wins, as it began later, instead of a KeyError
    (the server's 404 'cannot be found') for a name that is on its way in."""
    loader = GatedLoader()
    gate = loader.gates["/slow"] = threading.Event()
    if max_loaded is not None:  # lazy registration reads only the config: gate that instead
        def slow_check(name: str, path: str, max_rank: int | None = None) -> None:
            if path == "/slow":
                loader.entered.set()
                gate.wait(10)

        monkeypatch.setattr(registry_module, "check_registrable", slow_check)
    reg = LoRARegistry(loader, max_loaded)
    first = threading.Thread(target=reg.register, args=("a", "/slow"))
    first.start()
    assert loader.entered.wait(10)  # the first registration is in flight
    reg.unregister("a")  # KeyError before the fix
    gate.set()
    first.join(10)
    assert reg.paths == {} and reg.loaded == {}  # the later change, the unload, stands
    with pytest.raises(KeyError):  # a name neither served nor on its way in
        reg.unregister("a")
    reg.register("a", "/next")
    assert reg.paths == {"a": "/next"} and reg._in_force.keys() == {"a"}
