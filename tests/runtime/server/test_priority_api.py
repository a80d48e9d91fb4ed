"""`priority` over HTTP takes effect: on a server with one seat (`--max-num-seqs 1`), a request
of lower priority value preempts the running one instead of waiting for it to finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts an `argosy serve` process

C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def one_seat() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-num-seqs", "1")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def body(path: str, **kw) -> dict:  # noqa: ANN003
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True, **kw}
    if path == C:
        return {**base, "prompt": "Count to one thousand: 1, 2, 3,"}
    return {**base, "messages": [{"role": "user", "content": "Count to one thousand."}]}


def in_flight(server: ServerProcess) -> float:
    m = server.metrics()
    return m["argosy:num_requests_running"] + m["argosy:num_requests_waiting"]


async def until_idle(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while in_flight(server):
        assert time.monotonic() < deadline, "the server did not go idle"
        await asyncio.sleep(0.1)


async def finish_time(lines: AsyncIterator[str]) -> tuple[float, list[str]]:
    """Read a stream to its end: (when it ended, its data lines)."""
    data = [line async for line in lines if line.startswith("data: ")]
    return time.monotonic(), data


# Both directions, so the test fails if either endpoint drops the field.
@pytest.mark.parametrize(("low_path", "high_path"), [(C, CHAT), (CHAT, C)])
async def test_higher_priority_preempts_the_only_running_request(
        one_seat: ServerProcess, low_path: str, high_path: str) -> None:
    await until_idle(one_seat)
    preemptions = one_seat.metrics()["argosy:num_preemptions_total"]
    async with httpx.AsyncClient(base_url=one_seat.url, timeout=120) as h:
        low_body = body(low_path, priority=1, max_tokens=200, stream=True)
        async with h.stream("POST", low_path, json=low_body) as low:
            assert low.status_code == 200
            lines = low.aiter_lines()
            seen = 0
            async for line in lines:  # tokens flow (past chat's role chunk): it holds the seat
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            low_task = asyncio.create_task(finish_time(lines))
            high = await h.post(high_path, json=body(high_path, priority=0, max_tokens=4))
            high_done = time.monotonic()
            low_done, low_data = await low_task
    assert high.status_code == 200, high.text
    assert high.json()["usage"]["completion_tokens"] == 4
    # Without preemption the high request would wait for all 200 tokens of the low one.
    assert high_done < low_done
    assert one_seat.metrics()["argosy:num_preemptions_total"] >= preemptions + 1
    # The preempted request resumed and ran to its end.
    assert low_data[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in low_data[-2].replace(" ", "")
