"""Graceful drain (server/lifecycle.py): a request already in flight when SIGTERM arrives
finishes, even one that the drain counter (`Lifecycle.enter`) does not count yet."""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from argosy_runtime.server.lifecycle import DrainingServer, Lifecycle


class _Drain:
    """Records what the drain did."""

    def __init__(self) -> None:
        self.aborted = 0
        self.done = asyncio.Event()

    def abort_all(self) -> None:
        self.aborted += 1

    def on_done(self) -> None:
        self.done.set()


async def _admitting_request(lifecycle: Lifecycle, admitted: asyncio.Event,
                             finish: asyncio.Event) -> None:
    """A generation request as the handlers run it: `check_accepting` passed, then awaits
    (prompt tokenization, grammar compilation off the event loop) before `enter`."""
    await admitted.wait()
    lifecycle.enter()
    try:
        await finish.wait()
    finally:
        lifecycle.exit()


async def test_a_request_admitted_but_not_counted_yet_is_drained() -> None:
    """SIGTERM while a request is tokenizing its prompt: the counter showed 0 in flight, so
    the drain ended at once and uvicorn cut the request after its graceful timeout (5 s),
    whatever --drain-timeout said (seen live: "draining: 0 request(s) in flight", then
    "Cancel 1 running task(s), timeout graceful shutdown exceeded" and a 500)."""
    lifecycle = Lifecycle(drain_timeout=30)
    lifecycle.started = True
    admitted, finish, drain = asyncio.Event(), asyncio.Event(), _Drain()
    request = asyncio.create_task(_admitting_request(lifecycle, admitted, finish))
    await asyncio.sleep(0)
    assert lifecycle.num_active == 0  # not counted yet
    lifecycle.begin_drain(drain.abort_all, drain.on_done, requests=[request])
    assert not lifecycle.ready
    await asyncio.sleep(0.05)
    assert not drain.done.is_set()  # waits for the request in flight
    admitted.set()
    await asyncio.sleep(0.05)
    assert lifecycle.num_active == 1 and not drain.done.is_set()
    finish.set()
    await asyncio.wait_for(drain.done.wait(), timeout=5)
    assert drain.aborted == 0 and request.done()


async def test_requests_arriving_during_the_drain_are_not_waited_for() -> None:
    lifecycle = Lifecycle(drain_timeout=30)
    lifecycle.started = True
    drain = _Drain()
    lifecycle.begin_drain(drain.abort_all, drain.on_done, requests=[])
    late = asyncio.create_task(asyncio.sleep(60))  # e.g. a readiness probe: not in the snapshot
    try:
        await asyncio.wait_for(drain.done.wait(), timeout=5)
        assert drain.aborted == 0
    finally:
        late.cancel()


async def test_a_request_in_flight_past_the_drain_timeout_is_aborted() -> None:
    lifecycle = Lifecycle(drain_timeout=0.2)
    lifecycle.started = True
    drain = _Drain()
    stuck = asyncio.create_task(asyncio.sleep(60))
    try:
        lifecycle.begin_drain(drain.abort_all, drain.on_done, requests=[stuck])
        await asyncio.wait_for(drain.done.wait(), timeout=5)
        assert drain.aborted == 1
    finally:
        stuck.cancel()


async def test_sigterm_drains_the_http_requests_uvicorn_has_in_flight() -> None:
    """The wiring: DrainingServer hands the drain uvicorn's request tasks at SIGTERM."""
    lifecycle = Lifecycle(drain_timeout=30)
    lifecycle.started = True
    drain = _Drain()

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        raise AssertionError("not called")

    server = DrainingServer(uvicorn.Config(app), lifecycle, drain.abort_all)
    server._loop = asyncio.get_running_loop()
    admitted, finish = asyncio.Event(), asyncio.Event()
    request = asyncio.create_task(_admitting_request(lifecycle, admitted, finish))
    server.server_state.tasks.add(request)
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0.05)
    assert lifecycle.draining and not server.should_exit  # still draining
    admitted.set()
    await asyncio.sleep(0.05)
    assert not server.should_exit
    finish.set()
    for _ in range(100):
        if server.should_exit:
            break
        await asyncio.sleep(0.02)
    assert server.should_exit and not server.force_exit
    assert drain.aborted == 0
