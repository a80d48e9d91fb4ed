"""Where a LoRA adapter's decode cost goes (in-process, bfloat16): the step time of a batch of
decodes on the base model and with every request on the adapter, each with the fused C++
decode layers (which add the adapter's deltas too) and forced onto the module path.

    python bench/lora_step_cost.py --adapter /tmp/lora-smollm2 [--batch 8]
"""

from __future__ import annotations

import argparse
import time

from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.models.cpu_decode import CpuDecodeLayers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", required=True, help="a PEFT adapter folder for the model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="decode steps per measurement")
    args = p.parse_args()
    engine = LLMEngine(model=args.model, dtype="bfloat16", lora_modules={"a": args.adapter})
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(f"Story number {i}: once upon a time")
               for i in range(args.batch)]

    def ms_per_step(lora: str | None) -> float:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, lora_name=lora)
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return (time.perf_counter() - start) / steps * 1e3

    applies = CpuDecodeLayers.applies
    for label, lora, cpp in [("base, C++ decode layers", None, True),
                             ("base, module path", None, False),
                             ("adapter, C++ decode layers", "a", True),
                             ("adapter, module path", "a", False)]:
        CpuDecodeLayers.applies = applies if cpp else (lambda self, h, ctx: False)
        ms_per_step(lora)  # warm-up
        best = min(ms_per_step(lora) for _ in range(3))
        print(f"{label}: {best:.1f} ms/step (batch {args.batch} decode)")
    CpuDecodeLayers.applies = applies


if __name__ == "__main__":
    main()
