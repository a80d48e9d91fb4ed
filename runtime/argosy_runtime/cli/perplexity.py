"""`argosy perplexity`: perplexity of a model on a text file, through the real engine.

The file's tokens are scored in sliding windows of `--window` tokens advancing by
`--stride`: each window is one prompt run with `prompt_logprobs=0` (the engine returns the
log-probability of every prompt token after the first), and only tokens that no earlier
window scored are counted, so every token after the first is scored exactly once, with up
to `window - stride` tokens of context ahead of it. Prompts are prefilled in chunks
(`--chunk-tokens`); attention reads every token's K/V back from the KV cache, as in decoding,
so `--kv-cache-dtype int8` is measured at every position. Prints one JSON line:
{"perplexity", "tokens", "weight_bytes", "kv_bytes_per_token", ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "perplexity", help="Perplexity of a model on a text file (sliding window).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help="UTF-8 text file to score.")
    parser.add_argument("--model", default="smollm2-135m",
                        help="Model (as for `argosy serve`; default: %(default)s).")
    parser.add_argument("--quantization", default=None, help="int8 or int4 (default: none).")
    parser.add_argument("--quantization-group-size", type=int, default=128,
                        help="int4 group size: 32, 64 or 128 (default: %(default)s).")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto or int8 (default: %(default)s).")
    parser.add_argument("--dtype", default="auto",
                        help="auto, float32, float16, bfloat16 (default: %(default)s).")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda or auto (default: %(default)s).")
    parser.add_argument("--window", type=int, default=512, help="Tokens per window (default: %(default)s).")
    parser.add_argument("--stride", type=int, default=256,
                        help="Tokens the window advances by (default: %(default)s).")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Score only the first N tokens of the file.")
    parser.add_argument("--chunk-tokens", type=int, default=32,
                        help="Prefill chunk (engine token budget per step; the result does "
                             "not depend on it beyond float rounding) (default: %(default)s).")
    return parser


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window over tokens [0, num_tokens).

    Tokens first_scored..end-1 of window [begin, end) are the ones it contributes; together
    the windows score each of tokens 1..num_tokens-1 exactly once.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window - 1] = [1, {window - 1}], got {stride}")
    spans = []
    scored_up_to = 1  # token 0 has no context: never scored
    begin = 0
    while scored_up_to < num_tokens:
        end = min(begin + window, num_tokens)
        spans.append((begin, end, scored_up_to))
        scored_up_to = end
        begin = max(0, end - (window - stride))
    return spans


def perplexity(llm: Any, token_ids: list[int], window: int = 512, stride: int = 256) -> dict:
    """Perplexity of `token_ids` under `llm` (an argosy_runtime.LLM); all windows are sent as
    one batch so the engine schedules them together."""
    from argosy_runtime import SamplingParams

    spans = sliding_windows(len(token_ids), window, stride)
    prompts = [token_ids[b:e] for b, e, _ in spans]
    # Prompt-only: nothing is generated, so a window may be as long as max_model_len.
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params)
    nll = 0.0
    count = 0
    for (begin, end, first), out in zip(spans, outputs, strict=True):
        positions = out.prompt_logprobs
        if positions is None or len(positions) != end - begin:
            raise RuntimeError(f"engine returned {None if positions is None else len(positions)} "
                               f"prompt logprobs for a {end - begin}-token prompt")
        for i in range(first, end):
            entry = positions[i - begin]  # position i: logprob of token i given tokens < i
            nll -= entry[token_ids[i]].logprob
            count += 1
    return {"perplexity": math.exp(nll / count), "tokens": count, "nll": nll}


def run(args: argparse.Namespace) -> int:
    # A missing file, a bad --window/--stride/--max-tokens or engine option, a --model that
    # does not load: one line and exit 2, not a traceback (the window checks run before the
    # model loads, not after).
    try:
        sliding_windows(0, args.window, args.stride)
        if args.max_tokens is not None and args.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2 (a token is scored given the ones "
                             f"before it), got {args.max_tokens}")
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
        started = time.monotonic()
        llm = _load(args)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        print(f"argosy perplexity: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _score(args, llm, text, started)
    except ValueError as exc:  # e.g. a --window longer than the model's max_model_len
        print(f"argosy perplexity: error: {exc}", file=sys.stderr)
        return 2


def _load(args: argparse.Namespace) -> Any:
    from argosy_runtime import LLM

    return LLM(model=args.model, quantization=args.quantization,
               quantization_group_size=args.quantization_group_size,
               kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, device=args.device,
               max_num_batched_tokens=args.chunk_tokens, enable_prefix_caching=False)


def _score(args: argparse.Namespace, llm: Any, text: str, started: float) -> int:
    from argosy_runtime.model_runner import kv_cache_bytes_per_block
    from argosy_runtime.quantization import weight_bytes

    loaded = time.monotonic()
    engine = llm.engine
    token_ids = llm.get_tokenizer().encode(text)
    if args.max_tokens is not None:
        token_ids = token_ids[: args.max_tokens]
    if len(token_ids) < 2:
        raise SystemExit(f"{args.file}: fewer than 2 tokens to score")
    result = perplexity(llm, token_ids, args.window, args.stride)
    block = engine.cache_config.block_size
    result.update(
        weight_bytes=weight_bytes(engine.model),
        kv_bytes_per_token=kv_cache_bytes_per_block(engine.model, block, engine.cache_config.cache_dtype) / block,
        model=args.model, quantization=engine.quantization, kv_cache_dtype=args.kv_cache_dtype,
        dtype=str(engine.dtype).removeprefix("torch."), window=args.window, stride=args.stride,
        load_s=round(loaded - started, 2), score_s=round(time.monotonic() - loaded, 2),
    )
    del result["nll"]
    print(json.dumps(result))
    return 0
