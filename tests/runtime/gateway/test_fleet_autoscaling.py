"""`argosy fleet` autoscaling: the operator's decision function starts and drains replica
processes. The replicas are light real processes (fake_replica.py run with `argosy serve`'s
flags) so scaling is fast; the fleet, its gateway and the autoscaler are the real ones."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from argosy_runtime.fleet.supervisor import Fleet, FleetConfig

FAKE_SERVE = (sys.executable, str(Path(__file__).with_name("fake_replica.py")))


async def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def fast_fleet(tmp_path: Path, min_replicas: int, max_replicas: int, **policy: float
               ) -> FleetConfig:
    """One fake replica to start, autoscaled on a test-sized clock (policy: camelCase extras)."""
    return FleetConfig(
        model="tiny", replicas=1, min_replicas=min_replicas, max_replicas=max_replicas, port=0,
        autoscaling={"scrapeIntervalSeconds": 0.3, "stableWindowSeconds": 1.5,
                     "panicWindowSeconds": 0.6, "scaleDownStabilizationSeconds": 0.5, **policy},
        serve_command=FAKE_SERVE, health_interval_s=0.15, log_dir=str(tmp_path),
        ready_timeout_s=30, drain_timeout_s=10,
    )  # fmt: skip


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        FleetConfig(min_replicas=1)
    with pytest.raises(ValueError, match="replicas"):
        FleetConfig(replicas=5, min_replicas=1, max_replicas=3)
    with pytest.raises(ValueError, match="policy"):
        FleetConfig(policy="random")
    with pytest.raises(ValueError, match="replicas"):
        FleetConfig(replicas=0)  # zero only with autoscaling down to zero
    with pytest.raises(ValueError, match="max"):
        FleetConfig(replicas=0, min_replicas=0, max_replicas=0)
    assert FleetConfig(replicas=0, min_replicas=0, max_replicas=1).scales_from_zero
    # The policy is checked up front (it used to fail inside the autoscaler task, unseen).
    with pytest.raises(ValueError, match="panicWindowSeconds"):
        FleetConfig(min_replicas=1, max_replicas=2, autoscaling={"stableWindowSeconds": 5})


@pytest.mark.parametrize("overrides", [{"minReplicas": 3}, {"maxReplicas": 1},
                                       {"enabled": False}])
def test_autoscaling_overrides_cannot_set_what_min_and_max_set(overrides: dict) -> None:
    # They were silently overridden: `--autoscaling '{minReplicas: 3}'` ran with --min's 1,
    # `{enabled: false}` autoscaled all the same.
    with pytest.raises(ValueError, match=f"--autoscaling: {next(iter(overrides))} cannot be set"):
        FleetConfig(replicas=1, min_replicas=1, max_replicas=2, autoscaling=overrides)


def test_an_autoscaling_value_too_large_for_a_float_is_a_config_error() -> None:
    # YAML reads 1 followed by 400 zeros as an int: float() of it was an OverflowError
    # traceback from `argosy fleet`.
    proc = subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", "fleet", "--min",
                           "1", "--max", "2", "--autoscaling",
                           "{scrapeIntervalSeconds: 1" + "0" * 400 + "}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert "argosy fleet: --autoscaling: a value is out of range" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_cli_reports_a_bad_config_on_stderr() -> None:
    proc = subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", "fleet",
                           "--autoscaling", "[1]"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert "argosy fleet: --autoscaling" in proc.stderr and not proc.stdout


async def test_fleet_scales_to_zero_when_idle_and_a_request_wakes_it(tmp_path: Path) -> None:
    fleet = Fleet(fast_fleet(tmp_path, min_replicas=0, max_replicas=2,
                             scaleToZeroIdleSeconds=1))
    url = await fleet.start()
    try:
        first = fleet.processes[0]
        await wait_for(lambda: not fleet.processes, 20, "scale to zero")
        assert first.process.returncode == 0  # drained, not killed
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/ready") as resp:
                assert resp.status == 200
            started = time.monotonic()
            async with s.post(f"{url}/v1/completions",
                              json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
                woken = resp.headers["x-argosy-backend"]
            assert len(fleet.processes) == 1 and fleet.processes[0].url == woken != first.url
            reasons = [d.reason for d in fleet.decisions if d.changed]
            assert reasons[:2] == ["ScaleToZero", "ScaleFromZero"]
            print(f"request at zero answered after {time.monotonic() - started:.2f} s")
    finally:
        await fleet.stop()


async def test_requests_served_between_scrapes_keep_the_fleet_from_scaling_to_zero(
        tmp_path: Path) -> None:
    # Each request ends before the next scrape (the gauges read 0 throughout), so the gauges
    # alone took a replica answering one every 0.4 s for idle and scaled it to zero. The
    # replica's finished-requests counter moves between scrapes: not idle.
    fleet = Fleet(fast_fleet(tmp_path, min_replicas=0, max_replicas=2,
                             scaleToZeroIdleSeconds=1))
    url = await fleet.start()
    try:
        first = fleet.processes[0]
        async with aiohttp.ClientSession() as s:
            for _ in range(12):  # ~5 s: several times the idle limit
                async with s.post(f"{url}/v1/completions",
                                  json={"model": "tiny", "prompt": "x"}) as resp:
                    assert resp.status == 200
                await asyncio.sleep(0.4)
        assert fleet.processes == [first]
        assert all(d.reason != "ScaleToZero" for d in fleet.decisions)
        await wait_for(lambda: not fleet.processes, 20, "scale to zero once the traffic stops")
    finally:
        await fleet.stop()


async def test_fleet_scales_up_under_queueing_and_back_down_when_idle(tmp_path: Path) -> None:
    fleet = Fleet(fast_fleet(tmp_path, min_replicas=1, max_replicas=3, targetQueueDepth=1))
    url = await fleet.start()
    try:
        pool = fleet.gateway.pools["tiny"]
        first = fleet.processes[0]
        async with aiohttp.ClientSession() as s:
            # Six requests waiting on one replica, target one per replica: scale up to max.
            await s.post(f"{first.url}/control", json={"num_waiting": 6})
            await wait_for(lambda: len(pool.available()) == 3, 20, "3 replicas in rotation")
            assert len(fleet.live) == 3
            ups = [d for d in fleet.decisions if d.desired_replicas > d.current_replicas]
            assert ups and all(d.desired_replicas <= 3 for d in ups)
            # The new replicas take the traffic; the short prompts go least-load, which steers
            # them away from the replica that reports a queue.
            seen = set()
            for _ in range(9):
                async with s.post(f"{url}/v1/completions",
                                  json={"model": "tiny", "prompt": "x"}) as resp:
                    assert resp.status == 200
                    seen.add(resp.headers["x-argosy-backend"])
            assert seen == {p.url for p in fleet.processes if p is not first}
            # Idle again: drained back to the minimum, each drained process exiting cleanly.
            await s.post(f"{first.url}/control", json={"num_waiting": 0})
            drained = [p for p in fleet.processes]
            await wait_for(lambda: len(fleet.processes) == 1 and len(pool) == 1, 30, "scale down to 1")
            gone = [p for p in drained if p not in fleet.processes]
            assert len(gone) == 2
            await wait_for(lambda: all(p.process.returncode is not None for p in gone), 10, "exit")
            assert all(p.process.returncode == 0 for p in gone)
            async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
                assert resp.status == 200
    finally:
        await fleet.stop()
    assert all(p.process.returncode is not None for p in drained)


async def test_fleet_scale_down_keeps_the_replicas_holding_batches(tmp_path: Path) -> None:
    # Three idle replicas, the first and the last holding Batch API requests: the fleet drains
    # the middle one (by load alone it would drain the first), holds at two while both batches
    # run, then drains the one whose batch finished.
    # The batches are posted once the fleet is up, and the autoscaler runs from then on: a
    # 3 s scale-down stabilization (not 0.5) keeps it from draining a replica by load alone
    # before the posts land on a slow machine (CI saw `first` drained that way).
    config = dataclasses.replace(fast_fleet(tmp_path, min_replicas=1, max_replicas=3,
                                            scaleDownStabilizationSeconds=3), replicas=3)
    fleet = Fleet(config)
    await fleet.start()
    try:
        pool = fleet.gateway.pools["tiny"]
        first, second, third = fleet.processes
        async with aiohttp.ClientSession() as s:
            for proc in (first, third):
                await s.post(f"{proc.url}/control", json={"batch_pending": 25})
            await wait_for(lambda: fleet.processes == [first, third], 30, "the middle drained")
            await wait_for(lambda: any(d.reason == "BatchRequestsPending" for d in fleet.decisions),
                           10, "a decision held by the batches")
            assert fleet.processes == [first, third]
            await s.post(f"{first.url}/control", json={"batch_pending": 0})
            await wait_for(lambda: fleet.processes == [third] and len(pool) == 1, 30,
                           "the replica whose batch finished drained")
    finally:
        await fleet.stop()


@pytest.mark.parametrize("spelling", ["--batch-dir", "--batch-dir=", "--batch-d"])
async def test_fleet_with_a_shared_batch_dir_drains_replicas_holding_batches(
        tmp_path: Path, spelling: str) -> None:
    # The same, with `-- --batch-dir DIR`: the replicas share one folder and take over each
    # other's batches, so the fleet goes down to one replica although all three hold batches.
    # `--batch-d DIR` is the same folder to the replicas' argparse (an abbreviation); the
    # fleet did not count it as shared and held a replica per batch.
    folder = str(tmp_path / "batches")
    serve_args = (spelling + folder,) if spelling.endswith("=") else (spelling, folder)
    config = dataclasses.replace(fast_fleet(tmp_path, min_replicas=1, max_replicas=3,
                                            scaleDownStabilizationSeconds=3), replicas=3,
                                 serve_args=serve_args)
    from argosy_runtime.cli.main import build_parser  # what every replica makes of them

    assert build_parser().parse_args(["serve", *serve_args]).batch_dir == folder
    fleet = Fleet(config)
    await fleet.start()
    try:
        async with aiohttp.ClientSession() as s:
            for proc in fleet.processes:
                await s.post(f"{proc.url}/control", json={"batch_pending": 25})
            await wait_for(lambda: len(fleet.processes) == 1, 30, "down to one replica")
        # It scaled down while replicas held batches, and never held for them.
        assert any(d.desired_replicas < d.current_replicas and d.metrics.batch_replicas >= 2
                   for d in fleet.decisions)
        assert not any(d.reason == "BatchRequestsPending" for d in fleet.decisions)
    finally:
        await fleet.stop()


async def test_fleet_replaces_a_replica_that_dies(tmp_path: Path) -> None:
    fleet = Fleet(FleetConfig(model="tiny", replicas=2, port=0, serve_command=FAKE_SERVE,
                              health_interval_s=0.2, log_dir=str(tmp_path), ready_timeout_s=30))
    await fleet.start()
    try:
        victim = fleet.processes[0]
        await victim.kill()
        await wait_for(lambda: victim not in fleet.processes and len(fleet.processes) == 2
                       and len(fleet.gateway.pools["tiny"].available()) == 2, 20, "replacement")
        assert victim.url not in {r.url for r in fleet.gateway.pools["tiny"].replicas}
    finally:
        await fleet.stop()


async def test_a_replica_that_fails_to_start_at_zero_answers_the_held_requests(
        tmp_path: Path) -> None:
    # At zero, a held request wakes a replica that exits at start: the held requests get a
    # 503 saying so as soon as the start fails; they were held to the start-up timeout
    # (ready_timeout_s), then told only that no replica became ready in time.
    config = dataclasses.replace(
        fast_fleet(tmp_path, min_replicas=0, max_replicas=1), replicas=0, ready_timeout_s=120,
        serve_command=(sys.executable, "-c", "import sys; sys.exit(3)"))
    fleet = Fleet(config)
    url = await fleet.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            answers = await asyncio.gather(*(
                s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"p{i}"})
                for i in range(2)))
            for resp in answers:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "60"
                error = (await resp.json())["error"]
                assert error["type"] == "service_unavailable_error"
                assert "no replica of 'tiny' could start" in error["message"]
                assert "exited (code 3) before it was ready" in error["message"]
                assert "became ready within" not in error["message"]
        assert fleet.gateway.activators["tiny"].held == 0
        assert [d.reason for d in fleet.decisions if d.changed][:1] == ["ScaleFromZero"]
    finally:
        await fleet.stop()


async def test_two_bursts_during_one_activation_start_one_replica(tmp_path: Path) -> None:
    # Requests held at zero in two bursts, several autoscaler ticks apart, while the one
    # replica they woke is still starting (6 s): it serves them all, and no second replica is
    # started for the second burst.
    slow_start = ("import runpy, sys, time; time.sleep(6); sys.argv[0] = sys.argv[1]; "
                  "del sys.argv[1]; runpy.run_path(sys.argv[0], run_name='__main__')")
    config = dataclasses.replace(
        fast_fleet(tmp_path, min_replicas=0, max_replicas=3), replicas=0,
        serve_command=(sys.executable, "-c", slow_start, FAKE_SERVE[1]))
    fleet = Fleet(config)
    url = await fleet.start()
    try:
        activator = fleet.gateway.activators["tiny"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def post(i: int) -> str:
                async with s.post(f"{url}/v1/completions",
                                  json={"model": "tiny", "prompt": f"p{i}"}) as resp:
                    assert resp.status == 200
                    return resp.headers["x-argosy-backend"]

            first = [asyncio.create_task(post(i)) for i in range(3)]
            await wait_for(lambda: len(fleet.processes) == 1, 30, "a replica starting")
            await asyncio.sleep(1.0)  # ticks of the autoscaler with requests still held
            assert not fleet.processes[0].ready and activator.held == 3
            second = [asyncio.create_task(post(i)) for i in range(3, 6)]
            backends = await asyncio.gather(*first, *second)
        assert len(set(backends)) == 1 and len(fleet.processes) == 1
        assert [d.reason for d in fleet.decisions if d.changed] == ["ScaleFromZero"]
        assert len(list(tmp_path.glob("replica-*.log"))) == 1  # one replica ever started
    finally:
        await fleet.stop()
