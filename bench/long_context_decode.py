"""Decode step time at long contexts: what a chat UI's inter-token latency becomes once the
conversation is long.

For each (context, batch) it prefills `batch` random prompts of `context` tokens, decodes
`--output-len` tokens for each, and reports the time between the last first token and the last
final token divided by the decode steps in between (prefill excluded).

    python bench/long_context_decode.py --contexts 1024,4000 --batch-sizes 1,4
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="1024,4000", help="comma-separated prompt lengths")
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)

    import torch
    from argosy_runtime import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=1 << 30,
              max_model_len=max(contexts) + args.output_len)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    print("| context | batch | ms per decode step |")
    print("|---|---|---|")
    for context in contexts:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            # Fresh random prompts each time: no prefix-cache hits between measurements.
            prompts = [torch.randint(100, 40000, (context,), generator=gen).tolist()
                       for _ in range(batch)]
            outs = llm.generate(prompts, params)
            first = max(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.last_token_time for o in outs)
            print(f"| {context} | {batch} | {(last - first) / (args.output_len - 1) * 1e3:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
