"""`argosy bench serve` measured against a tiny in-process OpenAI server (aiohttp) whose delays
are known, so the numbers it must report are known too; and its arrival schedule against the
rate it claims to offer (vLLM's `vllm bench serve` methodology)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import pytest
from argosy_runtime.benchmarks import serve
from argosy_runtime.benchmarks.serve import arrival_times
from http_helpers import serve_app


def test_poisson_arrivals_offer_the_stated_rate() -> None:
    """The unscaled sum of 31 exponential gaps was 25.7 s for seed 0 (32 prompts at rate 1):
    the "rate 1" row had really been offered 1.25 requests/s (docs/benchmarks/serving.md
    reported 1.21 req/s completed at rate 1). vLLM rescales its gaps so the sends span exactly
    num/rate; here the first send is at 0 and the last at (num - 1)/rate."""
    for seed in range(4):
        times = arrival_times(32, 1.0, seed)
        assert times[0] == 0.0 and times == sorted(times)
        assert times[-1] == pytest.approx(31.0)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(set(gaps)) == len(gaps)  # still random gaps, not a fixed interval
    assert arrival_times(4000, 5.0, 3)[-1] == pytest.approx(3999 / 5.0)
    gaps = [b - a for a, b in zip(*(lambda t: (t, t[1:]))(arrival_times(4000, 5.0, 3)),
                                  strict=False)]
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.12)  # exponential: sd == mean
    assert arrival_times(1, 3.0, 0) == [0.0] and arrival_times(0, 3.0, 0) == []
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- fake server
FIRST_DELAY, GAP = 0.3, 0.1  # seconds: request -> first token, then between chunks


async def _fake_stream(request, app: dict) -> object:  # an OpenAI-compatible stream
    from aiohttp import web

    body = await request.json()
    chat = "messages" in body
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    if prompt.startswith("fail"):
        return web.json_response({"error": {"message": "busy"}}, status=429)
    app["running"] += 1
    app["max_running"] = max(app["max_running"], app["running"])
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def choice(text: str) -> dict:
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                           "text": text}

        # A role-only chunk first, at once (vLLM's and ours): not a token, not the TTFT.
        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
                    if chat else [choice("")]})
        await asyncio.sleep(FIRST_DELAY)
        n = body["max_tokens"]
        # 4 tokens in 3 chunks: " a", " b c" (two tokens in one chunk), " d"
        for i, text in enumerate((" a", " b c", " d")):
            if i:
                await asyncio.sleep(GAP)
            await send({"choices": [choice(text)]})
        await send({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                             "total_tokens": 5 + n}})
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        app["running"] -= 1


async def _run_against_fake(endpoint: str, specs: list[serve.RequestSpec],
                            *cli: str) -> tuple[dict, int]:
    from aiohttp import web

    state = {"running": 0, "max_running": 0}  # concurrent streams, now and at most

    async def handler(request: web.Request) -> object:
        return await _fake_stream(request, state)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner, url = await serve_app(app)
    try:
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        args = parser.parse_args(["--endpoint", endpoint, *cli])
        results, duration = await serve.run_rate(url, "m", specs,
                                                 float("inf"), args)
        return serve.summarize(results, duration, float("inf")), state["max_running"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_metrics_against_a_fake_server_with_known_delays(endpoint: str) -> None:
    specs = [serve.RequestSpec("fail please", 4)] + [serve.RequestSpec("hello there", 4)] * 2
    s, max_running = asyncio.run(_run_against_fake(endpoint, specs, "--max-concurrency", "1"))
    assert max_running == 1  # --max-concurrency 1: one stream at a time
    assert (s["completed"], s["failed"]) == (2, 1) and s["errors"] == ['HTTP 429: '
                                                                       '{"error": {"message": '
                                                                       '"busy"}}']
    # TTFT: from the send to the first chunk with text, not to the role-only chunk
    assert FIRST_DELAY <= s["p50_ttft_s"] < FIRST_DELAY + 0.25
    # one ITL per content chunk (as vLLM's client): 2 per request, each one GAP
    assert len(s["samples"]["itl"]) == 4
    assert all(GAP * 0.9 <= x < GAP + 0.2 for x in s["samples"]["itl"])
    # usage's 4 tokens (not 3 chunks): TPOT = (e2e - ttft) / 3 = 2 GAP / 3
    assert s["output_tokens"] == 8 and s["prompt_tokens"] == 10
    assert 2 * GAP / 3 * 0.9 <= s["mean_tpot_s"] < (2 * GAP + 0.3) / 3
    # one at a time: the run lasts two requests end to end; throughput over that duration
    one = FIRST_DELAY + 2 * GAP
    assert 2 * one * 0.95 <= s["duration_s"] < 2 * one + 0.8
    assert s["output_tokens_per_s"] == pytest.approx(8 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(2 / s["duration_s"])
