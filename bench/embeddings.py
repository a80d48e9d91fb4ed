"""Embeddings throughput: argosy `LLM.embed` vs transformers, and vLLM's pooling runner.

The same token-id inputs (mixed lengths, fixed seed) go to every system, last-token pooling,
L2-normalized, in the same dtype:
  argosy        `LLM.embed(inputs)`: continuous batching over the paged KV cache, prompts
                chunked by the token budget (the engine's defaults);
  transformers  `AutoModel` the way sentence-transformers' `encode` runs it: inputs sorted by
                length, batches of `--hf-batch-size` (32, its default), right padding with an
                attention mask, the last real token's hidden state;
  vllm          (with `--vllm-python`) `vllm.LLM(model, runner="pooling").embed(...)` in a
                subprocess, on an HF folder (`--hf-model`, from bench/export_hf.py).
Systems take turns, round after round, so a noisy shared machine slows them alike (vLLM runs
in its own process after them). Each round times the inputs with empty prefix caches
("cold"), then the same inputs again ("cached": both engines cache prefixes by default, so a
repeated input costs its last token or block; transformers has no cache). The table reports
each system's median seconds and inputs/s, and ratios to argosy in the same cache state. Vectors are checked
against argosy's (minimum cosine over the inputs), so all compute the same thing.

    .venv/bin/python bench/export_hf.py smollm2-135m /tmp/smollm2-hf
    .venv/bin/python bench/embeddings.py --num-inputs 128 --min-len 16 --max-len 256 \
        --rounds 3 --hf-model /tmp/smollm2-hf --vllm-python /tmp/vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM
from vllm.inputs import TokensPrompt
cfg = json.load(open(sys.argv[1]))
if __name__ == "__main__":
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], runner="pooling", seed=0,
              gpu_memory_utilization=0.25, max_model_len=cfg["max_model_len"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["inputs"]]
    llm.embed(prompts[:4])  # warm-up
    times = {"cold": [], "cached": []} if cfg["cached"] else {"cold": []}
    for _ in range(cfg["rounds"]):
        if cfg["cached"]:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.embed(prompts)
        times["cold"].append(time.perf_counter() - start)
        if cfg["cached"]:  # an encoder has no prefix cache
            start = time.perf_counter()
            llm.embed(prompts)
            times["cached"].append(time.perf_counter() - start)
    vectors = [o.outputs.embedding for o in out]
    print("RESULT " + json.dumps({"times": times, "vectors": vectors}))
"""


def make_inputs(n: int, min_len: int, max_len: int, vocab: int, seed: int,
                frame: tuple[int, int] | None = None) -> list[list[int]]:
    """Random token-id inputs; `frame` (an encoder's [CLS], [SEP] ids) wraps each one, as its
    tokenizer would."""
    rng = random.Random(seed)
    inputs = [[rng.randrange(5, vocab) for _ in range(rng.randint(min_len, max_len))]
              for _ in range(n)]
    return [[frame[0], *p, frame[1]] for p in inputs] if frame else inputs


def time_argosy(llm: Any, inputs: list[list[int]], cold: bool) -> tuple[float, torch.Tensor]:
    if cold:  # every token computed; else the previous round's prompts are in the cache
        llm.engine.kv_cache.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.embed(inputs)
    elapsed = time.perf_counter() - start
    return elapsed, torch.tensor([o.embedding for o in outs])


@torch.inference_mode()
def time_transformers(model: Any, inputs: list[list[int]], batch_size: int, cls: bool = False
                      ) -> tuple[float, torch.Tensor]:
    """`cls`: pool the first token (an encoder's [CLS]), else the last real one."""
    start = time.perf_counter()
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    vectors: list[torch.Tensor | None] = [None] * len(inputs)
    for b in range(0, len(order), batch_size):
        batch = [inputs[i] for i in order[b : b + batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, : len(p)] = torch.tensor(p)
            mask[row, : len(p)] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = (hidden[:, 0] if cls else
                hidden[torch.arange(len(batch)), mask.sum(dim=1) - 1]).float()
        for row, i in enumerate(order[b : b + batch_size]):
            vectors[i] = F.normalize(last[row], dim=0)
    elapsed = time.perf_counter() - start
    return elapsed, torch.stack(vectors)  # type: ignore[arg-type]


def run_vllm(args: argparse.Namespace, inputs: list[list[int]], max_model_len: int,
             cached: bool) -> tuple[dict[str, list[float]], torch.Tensor] | None:
    probe = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True)
    if probe.returncode != 0:
        print(f"vLLM: not importable with {args.vllm_python}; skipped", file=sys.stderr)
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json") as cfg:
        json.dump({"model": args.hf_model, "dtype": args.dtype, "rounds": args.rounds,
                   "inputs": inputs, "max_model_len": max_model_len, "cached": cached}, cfg)
        cfg.flush()
        proc = subprocess.run([args.vllm_python, "-c", _VLLM_SCRIPT, cfg.name],
                              capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            return result["times"], torch.tensor(result["vectors"])
    print(f"vLLM failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--hf-model", default=None,
                        help="HF folder of the same weights, for transformers and vLLM "
                             "(default: transformers reads the embedded GGUF; vLLM needs it)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-inputs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    from argosy_runtime import LLM
    from argosy_runtime.model_loader import resolve_model_path
    from transformers import AutoModel

    llm = LLM(model=args.model, dtype=args.dtype)
    spec = llm.engine.spec
    # An encoder (BERT): inputs framed by [CLS] ... [SEP], ids within the tokenizer's own
    # vocabulary (vLLM checks them against it), [CLS] pooled; no prefix cache to time.
    encoder = spec.is_encoder
    tokenizer = llm.engine.tokenizer
    frame = (tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")) if encoder else None
    vocab = tokenizer.vocab_size if encoder else spec.vocab_size
    inputs = make_inputs(args.num_inputs, args.min_len, args.max_len, vocab, args.seed, frame)
    num_tokens = sum(map(len, inputs))
    dtype = getattr(torch, args.dtype)
    if args.hf_model:
        hf = AutoModel.from_pretrained(args.hf_model, dtype=dtype)
    else:
        path, _ = resolve_model_path(args.model)
        hf = AutoModel.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    hf.eval()
    llm.embed(inputs[:4])  # warm-up (first-use kernel builds, allocator)
    time_transformers(hf, inputs[:4], args.hf_batch_size, encoder)

    # Each round: the inputs with empty prefix caches ("cold"), then the same inputs again
    # ("cached": an engine with prefix caching computes only each input's last token or
    # block; transformers has no cache, so it is timed cold only).
    times: dict[str, dict[str, list[float]]] = {
        "argosy": {"cold": [], "cached": []}, "transformers": {"cold": []}}
    vectors: dict[str, torch.Tensor] = {}
    if encoder:
        del times["argosy"]["cached"]
    for _ in range(args.rounds):
        for kind in times["argosy"]:
            elapsed, vectors["argosy"] = time_argosy(llm, inputs, cold=kind == "cold")
            times["argosy"][kind].append(elapsed)
        elapsed, vectors["transformers"] = time_transformers(hf, inputs, args.hf_batch_size,
                                                             encoder)
        times["transformers"]["cold"].append(elapsed)
    if args.vllm_python:
        del hf
        # its own process: after ours, not interleaved
        vllm = run_vllm(args, inputs, min(2048, llm.engine.max_model_len), not encoder)
        if vllm is not None:
            times["vllm"], vectors["vllm"] = vllm

    print(f"{args.num_inputs} inputs, {num_tokens} tokens ({args.min_len}-{args.max_len} "
          f"each), {args.dtype}, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print("| system | caches | median s | inputs/s | tokens/s | argosy / system | "
          "min cosine to argosy |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, by_kind in times.items():
        for kind, ts in by_kind.items():
            if kind not in times["argosy"]:  # an encoder has no cached pass to compare
                continue
            ours = statistics.median(times["argosy"][kind])
            median = statistics.median(ts)
            cosine = F.cosine_similarity(vectors[name].float(), vectors["argosy"].float()).min()
            rows.append({"system": name, "caches": kind, "seconds": ts, "median_s": median,
                         "inputs_per_s": args.num_inputs / median,
                         "tokens_per_s": num_tokens / median,
                         "speedup_of_argosy": median / ours, "min_cosine": float(cosine)})
            print(f"| {name} | {kind} | {median:.2f} | {args.num_inputs / median:.1f} | "
                  f"{num_tokens / median:.0f} | {median / ours:.2f}x | {float(cosine):.4f} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"args": vars(args), "num_tokens": num_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
