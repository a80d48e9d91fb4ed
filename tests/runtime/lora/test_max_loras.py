"""`max_loras` (vLLM's --max-loras): at most N distinct LoRA adapters among the requests of one
step. A request whose adapter would be one too many waits in place; base-model requests and
requests on adapters already running pass it; nobody is preempted for it; outputs never change,
only the schedule."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from argosy_runtime import LLM, LLMEngine, SamplingParams
from argosy_runtime.config import SchedulerConfig
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.kv_cache import KVCacheManager
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.scheduler import Scheduler, SchedulerOutput

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks  # noqa: E402
from engine_helpers import scheduler_step as step  # noqa: E402
from test_lora_engine import (  # noqa: E402
    adapters,  # noqa: F401  (fixtures)
    model_dir,  # noqa: F401
    run,
)

# ---- the scheduler alone, with stand-in adapters ----------------------------------------------

A, B, C, D = (SimpleNamespace(name=n, cache_salt=hash(n)) for n in "ABCD")


def make(max_loras: int | None, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, max_loras=max_loras)
    return Scheduler(cfg, KVCacheManager(64, 4))


def req(rid: str, lora: SimpleNamespace | None, t: float, priority: int = 0) -> Request:
    r = Request(rid, [10 * int(t) + i for i in range(3)], SamplingParams(max_tokens=50),
                max_tokens=50, arrival_time=t, priority=priority)
    r.lora = lora  # type: ignore[assignment]
    return r


def ids(out: SchedulerOutput) -> list[str]:
    return [sr.request.request_id for sr in out.scheduled]


def adapters_of(out: SchedulerOutput) -> set[str]:
    return {sr.request.lora.name for sr in out.scheduled if sr.request.lora is not None}


def finish(s: Scheduler, *rids: str) -> None:
    for rid in rids:
        s.finish_request(s.requests[rid], RequestStatus.FINISHED_STOPPED)


def test_a_new_adapter_waits_in_place_while_base_and_running_adapters_pass_it() -> None:
    s = make(max_loras=2)
    for r in (req("a1", A, 0), req("b1", B, 1), req("c1", C, 2), req("base", None, 3),
              req("a2", A, 4), req("d1", D, 5), req("b2", B, 6)):
        s.add_request(r)
    out = step(s)
    assert ids(out) == ["a1", "b1", "base", "a2", "b2"] and adapters_of(out) == {"A", "B"}
    assert [r.request_id for r in s.waiting] == ["c1", "d1"]  # their order kept
    assert adapters_of(step(s)) == {"A", "B"}
    finish(s, "a1")
    assert adapters_of(step(s)) == {"A", "B"}  # a2 still runs on A: C keeps waiting
    finish(s, "a2")
    out = step(s)  # A is gone: the first held request, not the later one, takes its place
    assert "c1" in ids(out) and adapters_of(out) == {"B", "C"}
    assert [r.request_id for r in s.waiting] == ["d1"]
    finish(s, "b1", "b2", "c1")
    assert ids(step(s)) == ["base", "d1"]
    assert s.num_preemptions == 0


def test_held_requests_keep_priority_order_and_never_preempt() -> None:
    s = make(max_loras=1, max_seqs=2)
    s.add_request(req("a1", A, 0, priority=5))
    s.add_request(req("a2", A, 1, priority=5))
    step(s)
    # Both seats are taken by less urgent requests; more urgent ones on a new adapter are held
    # by the cap, which preempts nobody (a base-model request of the same urgency would).
    s.add_request(req("b1", B, 2, priority=1))
    s.add_request(req("c1", C, 3, priority=0))
    for _ in range(3):
        assert ids(step(s)) == ["a1", "a2"]
    assert s.num_preemptions == 0 and [r.request_id for r in s.waiting] == ["c1", "b1"]
    finish(s, "a1", "a2")
    assert ids(step(s)) == ["c1"]  # the most urgent first, alone on its adapter
    finish(s, "c1")
    assert ids(step(s)) == ["b1"]


def test_a_preempted_request_resumes_under_the_cap() -> None:
    # A request preempted on A waits for the cap like any waiting one, and resumes once the
    # adapter that took its place is gone.
    s = make(max_loras=1, max_seqs=1)
    s.add_request(req("a1", A, 0, priority=5))
    step(s)
    s.add_request(req("c1", C, 1, priority=0))  # held: no preemption of a1 for it
    s.add_request(req("base", None, 2, priority=0))  # not held: preempts a1
    out = step(s)
    assert ids(out) == ["base"] and [r.request_id for r in out.preempted] == ["a1"]
    finish(s, "base")
    assert ids(step(s)) == ["c1"]  # a1 (preempted, less urgent) waits behind c1
    out = step(s)
    assert ids(out) == ["c1"] and [r.request_id for r in s.waiting] == ["a1"]
    finish(s, "c1")
    assert ids(step(s)) == ["a1"]


def test_running_adapters_over_the_cap_keep_running() -> None:
    s = make(max_loras=None)
    for i, lora in enumerate((A, B, C)):
        s.add_request(req(f"r{i}", lora, i))
    step(s)
    s.config = dataclasses.replace(s.config, max_loras=1)  # the cap comes after they run
    s.add_request(req("d1", D, 3))
    s.add_request(req("a2", A, 4))
    s.add_request(req("base", None, 5))
    out = step(s)
    assert ids(out) == ["r0", "r1", "r2", "a2", "base"] and not out.preempted
    assert [r.request_id for r in s.waiting] == ["d1"]


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_max_loras_is_a_value_error_naming_the_flag(bad: object) -> None:
    with pytest.raises(ValueError, match=r"max_loras \(--max-loras\) must be an integer >= 1"):
        EngineArgs(max_loras=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--max-loras"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                        max_loras=bad)  # type: ignore[arg-type]
    # Before any model loads (this path does not exist).
    with pytest.raises(ValueError, match="--max-loras"):
        LLM(model="/nonexistent/model", max_loras=bad)


def test_max_loras_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).max_loras is None
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-loras", "3"])).max_loras == 3
    with pytest.raises(ValueError, match="--max-loras"):
        EngineArgs.from_cli_args(parser.parse_args(["--max-loras", "0"]))
    assert "distinct LoRA adapters in one engine step" in " ".join(parser.format_help().split())


# ---- the engine, with real adapters -----------------------------------------------------------

def run_recording(engine: LLMEngine, jobs: list[tuple[str | None, int]]
                  ) -> tuple[list[list[int]], list[list[tuple[str, str | None]]]]:
    """Add jobs (adapter, prompt index) as r0, r1, ... at once; run them to the end. Returns
    the outputs and, per step, the (request id, adapter name) of each scheduled request."""
    steps: list[list[tuple[str, str | None]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        steps.append([(sr.request.request_id, sr.request.lora and sr.request.lora.name)
                      for sr in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return run(engine, jobs), steps


def test_engine_runs_one_adapter_per_step_and_outputs_do_not_change(
        model_dir, adapters) -> None:  # noqa: F811
    jobs = [("all", 0), ("attn-rs", 1), (None, 2), ("all", 1), ("attn-rs", 0), (None, 1)]

    def engine(**kw: object) -> LLMEngine:
        return LLMEngine(model=str(model_dir), dtype="float32",
                         lora_modules={k: str(v) for k, v in adapters.items()}, **kw)

    free_outputs, free_steps = run_recording(engine(), jobs)
    assert len({lora for _, lora in free_steps[0]} - {None}) == 2  # without a cap: both at once

    capped = engine(max_loras=1)
    outputs, steps = run_recording(capped, jobs)
    assert outputs == free_outputs  # only the schedule changes
    for scheduled in steps:
        assert len({lora for _, lora in scheduled} - {None}) <= 1, scheduled
    # Step 1: both base-model requests and both "all" requests; "attn-rs" ones wait ...
    assert [rid for rid, _ in steps[0]] == ["r0", "r2", "r3", "r5"]
    # ... until every "all" request has finished, then they run together.
    first_attn = next(i for i, s in enumerate(steps) if any(lora == "attn-rs" for _, lora in s))
    assert all(lora != "all" for s in steps[first_attn:] for _, lora in s)
    assert {rid for rid, _ in steps[first_attn]} >= {"r1", "r4"}
    assert capped.get_stats().num_preemptions == 0
    assert_no_leaks(capped)
