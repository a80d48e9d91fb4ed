"""bf16 batch-1 decode tokens/s of a random Qwen3-shaped model (SmolLM2-135M sizes plus the
per-head q/k norms): the C++ decode layers vs the module path, alternating.

    .venv/bin/python bench/qwen3_decode_layers.py

Per path and round: one request of 128 greedy tokens stepped by hand; tokens/s = 1 / the median
decode step time (the machine is shared: medians resist other jobs' bursts)."""
import statistics
import sys
import tempfile
import time

sys.path.insert(0, "tests/runtime")
import torch  # noqa: E402
from argosy_runtime import LLM, SamplingParams  # noqa: E402
from model_factory import make_random_model_dir  # noqa: E402

folder = make_random_model_dir(tempfile.mkdtemp(prefix="qwen3-bench-"), "qwen3", name="qwen3-576", num_hidden_layers=30,
                               hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64, dtype=torch.bfloat16)
llm = LLM(model=str(folder), dtype="bfloat16", enable_prefix_caching=False)
engine, model = llm.engine, llm.engine.model
cpp = model.cpu_decode
assert cpp is not None
prompt = [1, 504, 2365, 282, 260, 5887, 3733, 4147]
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


def run(tag: str) -> tuple[list[float], list[int]]:
    engine.add_request(tag, prompt, params)
    times, tokens = [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        tokens = outs[0].outputs[0].token_ids if outs else tokens
    return times[1:], list(tokens)  # [0]: the prefill step


for layers in (cpp, None):  # warm-up both paths
    model.cpu_decode = layers
    run(f"warm-{layers is None}")
toks = {}
for rnd in range(3):
    for name, layers in (("cpp", cpp), ("module", None)):
        model.cpu_decode = layers
        times, toks[name] = run(f"{name}-{rnd}")
        print(f"round {rnd} {name:6s} median {1 / statistics.median(times):6.1f} tok/s  "
              f"best {1 / min(times):6.1f} tok/s  ({len(times)} steps)", flush=True)
print("same tokens:", toks["cpp"] == toks["module"])
