"""Does a huge prompt stall the other clients of `argosy serve`?

One client streams a long completion (ignore_eos) and records when each chunk arrives; once
the stream runs, a second client posts a big prompt (~15 MB of text by default) to a route.
Reported per case: the second request's status and latency, the stream's largest gap between
two chunks while it was in flight against the gap before it and its chunks meanwhile (a loop
that tokenizes on the event loop shows a gap as long as the tokenization), and the slowest
GET /health meanwhile (polled every 50 ms: the event loop's own latency, which CPU taken from
the engine thread does not move).

    .venv/bin/argosy serve --model smollm2-135m --dtype float32 --max-model-len 2048 \
        --kv-cache-memory 256MiB --port 8011 &
    .venv/bin/python bench/big_prompt_stall.py --url http://127.0.0.1:8011 --mb 15
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

CASES = {  # name: (path, body of a prompt `text`)
    "completion": ("/v1/completions", lambda t: {"prompt": t, "max_tokens": 1}),
    "completion_truncated": ("/v1/completions", lambda t: {
        "prompt": t, "max_tokens": 1, "truncate_prompt_tokens": 100}),
    "chat": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": t}], "max_tokens": 1}),
    "tokenize": ("/tokenize", lambda t: {"prompt": t}),
    # As many tiny messages as fill the same bytes (~40 bytes each): the chat template's cost.
    "chat_many_messages": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": f"w{i}"} for i in range(len(t) // 40)],
        "max_tokens": 1}),
}


def stream(url: str, arrivals: list[float], stop: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.monotonic())
            if stop.is_set():
                return


def poll_health(url: str, latencies: list[tuple[float, float]], stop: threading.Event) -> None:
    """GET /health every 50 ms: its latency is the event loop's, whatever the engine does."""
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            sent = time.monotonic()
            client.get(url + "/health")
            latencies.append((sent, time.monotonic() - sent))
            time.sleep(0.05)


def run_case(url: str, name: str, text: str) -> dict:
    path, make = CASES[name]
    payload = json.dumps(make(text)).encode()
    arrivals: list[float] = []
    health: list[tuple[float, float]] = []
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(url, arrivals, stop)),
               threading.Thread(target=poll_health, args=(url, health, stop))]
    for t in threads:
        t.start()
    while len(arrivals) < 20:  # the stream is running
        time.sleep(0.05)
    start = time.monotonic()
    r = httpx.post(url + path, content=payload, timeout=600,
                   headers={"content-type": "application/json"})
    end = time.monotonic()
    time.sleep(1.0)  # a few chunks after it
    stop.set()
    for t in threads:
        t.join()
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b < start]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end]
    return {"case": name, "bytes": len(payload), "status": r.status_code,
            "latency_s": round(end - start, 2),
            "max_gap_before_ms": round(max(before) * 1000),
            "max_gap_during_ms": round(max(during, default=end - start) * 1000),
            "chunks_during": sum(start <= t <= end for t in arrivals),
            "max_health_ms_during": round(max(
                (lat for sent, lat in health if sent <= end and sent + lat >= start),
                default=0) * 1000),
            "message": r.json().get("error", {}).get("message", "")[:100]
            if r.status_code >= 400 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--mb", type=float, default=15.0, help="prompt size in MB")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    # Varied words (not one word repeated), so the BPE has real work per word.
    words = [f"w{i % 9973}x{i % 101}" for i in range(4096)]
    unit = " ".join(words) + " "
    text = (unit * int(args.mb * 1e6 / len(unit) + 1))[: int(args.mb * 1e6)]
    for name in args.cases.split(","):
        print(json.dumps(run_case(args.url, name, text)), flush=True)


if __name__ == "__main__":
    main()
