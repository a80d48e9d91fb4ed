"""How many long sequences a sliding-window model runs at once, with and without releasing the
KV blocks that fall behind the window (kv_cache/sliding_window.py).

A tiny random Mistral-like model (every layer windowed; tests/runtime/model_factory.py) on
the CPU, float32, greedy: REQUESTS sequences of PROMPT + NEW tokens, all added at once, in a
KV pool of POOL blocks that holds one whole sequence. "keep" is the engine with the window
unknown to the KV manager (every block kept until the request ends, as before); "release"
is the engine as it is. It prints, per mode, the most requests running in one step, the
most blocks held, the preemptions, the wall time, and whether both modes' tokens are equal.

    python bench/sliding_window_blocks.py
    python bench/sliding_window_blocks.py --window 128 --requests 8 --new 1500
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from model_factory import make_random_model_dir  # noqa: E402


def run(folder: Path, args: argparse.Namespace, release: bool) -> dict:
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32
    kwargs = dict(model=str(folder), dtype="float32", block_size=args.block_size,
                  max_num_batched_tokens=args.step_tokens, max_num_seqs=args.requests,
                  kv_cache_memory=args.pool * args.block_size * bytes_per_token)
    if release:
        engine = LLMEngine(**kwargs)
    else:  # the KV manager is told no window: it keeps every block (the old behaviour)
        with mock.patch("argosy_runtime.engine.uniform_sliding_window", lambda _: None):
            engine = LLMEngine(**kwargs)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = [(7 * i + 13 * j) % 40000 + 3 for j in range(args.prompt)]
        engine.add_request(f"r{i}", prompt, params)
    kv = engine.kv_cache
    tokens: dict[str, list[int]] = {}
    most_running = most_blocks = steps = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, engine.scheduler.num_running)
        most_blocks = max(most_blocks, kv.num_blocks - kv.num_free_blocks)
        steps += 1
    return dict(mode="release" if release else "keep", usable_blocks=kv.num_blocks,
                most_running=most_running, most_blocks=most_blocks, steps=steps,
                preemptions=engine.get_stats().num_preemptions,
                seconds=round(time.perf_counter() - started, 1), tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=768)
    p.add_argument("--pool", type=int, default=65, help="KV blocks, the null block included")
    p.add_argument("--step-tokens", type=int, default=256, help="max_num_batched_tokens")
    args = p.parse_args()
    folder = make_random_model_dir(Path(tempfile.mkdtemp()), "mistral", name="window-bench",
                                   max_position_embeddings=args.prompt + args.new,
                                   extra_config={"sliding_window": args.window})
    print(f"window {args.window}, block_size {args.block_size}, {args.requests} requests of "
          f"{args.prompt} + {args.new} tokens "
          f"({-(-(args.prompt + args.new) // args.block_size)} blocks each), "
          f"pool {args.pool} blocks, {args.step_tokens} tokens per step")
    results = [run(folder, args, release) for release in (False, True)]
    for r in results:
        print(f"{r['mode']:>8}: usable blocks {r['usable_blocks']}, most running "
              f"{r['most_running']}, most blocks held {r['most_blocks']}, preemptions "
              f"{r['preemptions']}, steps {r['steps']}, {r['seconds']} s")
    print("tokens equal:", results[0]["tokens"] == results[1]["tokens"])


if __name__ == "__main__":
    main()
