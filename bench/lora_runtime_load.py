"""Loading a LoRA adapter into a running server (vLLM's /v1/load_lora_adapter API): how long a
load and an unload take, how long the first request on the new adapter takes, and what a load
does to a stream that is running meanwhile (its largest gap between tokens).

    python bench/lora_runtime_load.py --base-url http://127.0.0.1:8126 \\
        --model smollm2-135m --adapter /tmp/lora-smollm2 --cycles 5 --json out.json

The server must allow runtime updates (argosy: --allow-runtime-lora-updates; vLLM:
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-lora). bench/lora_compare.sh runs it against
both, one server at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx


def stream_gaps(base_url: str, model: str, stop: threading.Event, out: list[float]) -> None:
    """Stream long completions until `stop`; append each token's arrival time to `out`."""
    body = {"model": model, "prompt": "Tell me a long story about a ship.", "max_tokens": 4000,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out.append(time.perf_counter())
                    if stop.is_set():
                        break


def max_gap(times: list[float], start: float, end: float) -> float:
    """The longest wait for a token that overlaps [start, end] (the last token before the
    window to the first one after it included)."""
    before = [t for t in times if t < start][-1:]
    after = [t for t in times if t > end][:1]
    window = before + [t for t in times if start <= t <= end] + after
    return max((b - a for a, b in zip(window, window[1:], strict=False)), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the base model's served name")
    parser.add_argument("--adapter", required=True, help="a PEFT adapter folder")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--label", default="server")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    times: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=stream_gaps, args=(args.base_url, args.model, stop, times),
                                daemon=True)
    streamer.start()
    time.sleep(3.0)  # the stream is in steady decode
    loads, unloads, first_uses, windows = [], [], [], []
    with httpx.Client(base_url=args.base_url, timeout=600) as http:
        for i in range(args.cycles):
            name = f"runtime-{i}"
            t0 = time.perf_counter()
            resp = http.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": args.adapter})
            t1 = time.perf_counter()
            resp.raise_for_status()
            loads.append(t1 - t0)
            windows.append((t0, t1))
            resp = http.post("/v1/completions", json={"model": name, "prompt": "Hello",
                                                      "max_tokens": 1, "temperature": 0})
            first_uses.append(time.perf_counter() - t1)
            resp.raise_for_status()
            t2 = time.perf_counter()
            http.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
            unloads.append(time.perf_counter() - t2)
            time.sleep(1.0)
    time.sleep(1.0)
    stop.set()
    load_gaps = [max_gap(times, t0, t1) for t0, t1 in windows]
    steady = [b - a for a, b in zip(times, times[1:], strict=False)]
    result = {
        "label": args.label,
        "cycles": args.cycles,
        "load_s_median": statistics.median(loads),
        "first_request_s_median": statistics.median(first_uses),
        "unload_s_median": statistics.median(unloads),
        "stream_itl_s_median": statistics.median(steady) if steady else None,
        "stream_max_gap_during_load_s_median": statistics.median(load_gaps),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
