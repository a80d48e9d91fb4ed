"""How many long sequences a sliding-window model runs at once, with and without releasing the
KV blocks that fall behind the window (kv_cache/sliding_window.py, kv_cache/layout.py).

A tiny random model (tests/runtime/model_factory.py) on the CPU, float32, greedy: REQUESTS
sequences of PROMPT + NEW tokens, all added at once, in KV memory for POOL blocks of every
layer (one whole sequence). `--arch mistral`: every layer windowed, one block table.
`--arch gemma3`: Gemma 3's pattern, five windowed layers to one full, on the hybrid layout
(a table per kind of layer on one pool of pages). "keep" is the engine told nothing of the
windows: one block table, every block kept until the request ends (as before either was
built); "release" is the engine as it is. It prints, per mode, the most requests running in
one step, the most pages held (one page: a block of `page_layers` layers), the preemptions,
the wall time, and whether both modes' tokens are equal. `--draft`: speculative decoding with
a separate draft (a copy of the model, 3 tokens) whose cache (spec_decode/draft_cache.py)
takes a page per target page from the same memory, which is doubled; in "keep" mode the
draft's cache is one table too (as it was before drafts had layouts of their own).

    python bench/sliding_window_blocks.py
    python bench/sliding_window_blocks.py --arch gemma3
    python bench/sliding_window_blocks.py --arch gemma3 --draft
    python bench/sliding_window_blocks.py --arch gemma3 --draft --threads 1
    python bench/sliding_window_blocks.py --window 128 --requests 8 --new 1500
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from argosy_runtime import LLMEngine, SamplingParams  # noqa: E402
from argosy_runtime.kv_cache import single_table_layout  # noqa: E402
from model_factory import make_random_model_dir  # noqa: E402


def bytes_per_token(folder: Path) -> int:
    """K and V of every layer, float32."""
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


def run(folder: Path, args: argparse.Namespace, release: bool) -> dict:
    memory = args.pool * args.block_size * bytes_per_token(folder)
    kwargs = dict(model=str(folder), dtype="float32", block_size=args.block_size,
                  max_num_batched_tokens=args.step_tokens, max_num_seqs=args.requests,
                  kv_cache_memory=memory)
    if args.draft:
        kwargs.update(kv_cache_memory=2 * memory, speculative={
            "method": "draft", "model": str(folder), "num_speculative_tokens": 3,
            "adaptive": False})
    if release:
        engine = LLMEngine(**kwargs)
    else:  # one table, no window known to the KV manager: every block kept
        def one_table(windows, num_layers, max_len):  # noqa: ANN001, ANN202
            return single_table_layout(num_layers)

        with mock.patch("argosy_runtime.engine.kv_cache_layout", one_table), \
                mock.patch("argosy_runtime.spec_decode.draft_cache.kv_cache_layout", one_table):
            engine = LLMEngine(**kwargs)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = [(7 * i + 13 * j) % 40000 + 3 for j in range(args.prompt)]
        engine.add_request(f"r{i}", prompt, params)
    kv = engine.kv_cache
    tokens: dict[str, list[int]] = {}
    most_running = most_blocks = steps = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, engine.scheduler.num_running)
        most_blocks = max(most_blocks, kv.num_blocks - kv.num_free_blocks)
        steps += 1
    layout = engine.cache_config.layout
    return dict(mode="release" if release else "keep", usable_blocks=kv.num_blocks,
                page_layers=layout.page_layers, tables=layout.num_tables,
                most_running=most_running, most_blocks=most_blocks, steps=steps,
                preemptions=engine.get_stats().num_preemptions,
                drafts=engine.get_stats().spec_decode_num_draft_tokens,
                accepted=engine.get_stats().spec_decode_num_accepted_tokens,
                seconds=round(time.perf_counter() - started, 1),
                cpu_seconds=round(time.process_time() - cpu_started, 1), tokens=tokens)


def model_dir(args: argparse.Namespace) -> Path:
    config: dict = {"sliding_window": args.window}
    layers = 2
    if args.arch == "gemma3":  # gemma-3-1b's pattern: every sixth layer full
        layers = 6
        config.update(layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                                   for i in range(layers)], query_pre_attn_scalar=16)
    return make_random_model_dir(Path(tempfile.mkdtemp()), args.arch, name="window-bench",
                                 num_hidden_layers=layers,
                                 max_position_embeddings=args.prompt + args.new,
                                 init_std=0.15 if args.arch == "gemma3" else 0.5,
                                 extra_config=config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["mistral", "gemma3"], default="mistral")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=768)
    p.add_argument("--pool", type=int, default=65,
                   help="KV memory in blocks of every layer (the null block included)")
    p.add_argument("--step-tokens", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--draft", action="store_true",
                   help="speculate with a separate draft (a copy of the model)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 keeps other jobs on a small "
                        "machine from skewing the comparison (compare the CPU seconds)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    folder = model_dir(args)
    print(f"{args.arch}, window {args.window}, block_size {args.block_size}, {args.requests} requests of "
          f"{args.prompt} + {args.new} tokens "
          f"({-(-(args.prompt + args.new) // args.block_size)} blocks each), "
          f"pool {args.pool} blocks, {args.step_tokens} tokens per step")
    results = [run(folder, args, release) for release in (False, True)]
    for r in results:
        print(f"{r['mode']:>8}: {r['tables']} table(s), pages of {r['page_layers']} layers, "
              f"usable pages {r['usable_blocks']}, most running "
              f"{r['most_running']}, most pages held {r['most_blocks']}, preemptions "
              f"{r['preemptions']}, steps {r['steps']}, {r['seconds']} s "
              f"({r['cpu_seconds']} CPU s)"
              + (f", drafts accepted {r['accepted']}/{r['drafts']}" if args.draft else ""))
    print("tokens equal:", results[0]["tokens"] == results[1]["tokens"])


if __name__ == "__main__":
    main()
