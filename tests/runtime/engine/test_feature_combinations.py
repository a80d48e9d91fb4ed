"""Scheduling features combined: greedy output must not depend on how the engine got there.

Each feature has its own tests; bugs hide where they combine. Every case below runs a
seeded, deterministic mix of requests (shared prefixes, different lengths, staggered
arrivals, some aborted mid-flight) through an engine with a pair or triple of features on
(prefix caching, chunked prefill with a small token budget, preemption forced by a tiny KV
pool or few seats, priorities, n-gram / self-draft / int8-draft speculation, n > 1, LoRA
adapters in one batch, a sliding-window model, an int8 KV cache) and checks, per request,
against the same model run one request at a time with those features off (same KV dtype and
adapters):

- the same greedy tokens, and logprobs within float32 noise (an aborted request: a prefix);
- seeded sampling (n > 1, without speculation) draws the same tokens;
- after the run every block is back in the pool;
- before every step, each position a scheduled sequence reads from the cache holds the K/V
  of that sequence's own tokens (adapter included), as last written by a step: a prefix-cache
  hit never serves K/V that were never written (or were overwritten since).

Each case also asserts that its features really engaged (preemptions, cache hits, drafts,
aborts), so a case cannot silently degrade into a plain run.
A wider random search over the same space (run locally: about 200 random combinations) found
no mismatch; these cases are kept as the compact guard.
"""

from __future__ import annotations

import random

import pytest
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.model_runner import KV_SCALE_DTYPE
from engine_helpers import assert_no_leaks, run_with_arrivals
from model_factory import make_peft_adapter, make_random_model_dir

VOCAB = 49152
WINDOW = 10  # the Mistral model's sliding window: ends inside a 4-token block
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# float32: tiny models agree to ~1e-5 across batch shapes. int8 KV: one rounding step of a
# quantized K/V (a batch-dependent float difference crossing a rounding boundary) moves a
# logprob by ~1e-3, with or without any scheduling feature.
LOGPROB_TOL = {"auto": 2e-4, "int8": 1e-2}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("combo")
    llama = make_random_model_dir(root, "llama", name="llama", max_position_embeddings=256)
    mistral = make_random_model_dir(root, "mistral", name="mistral", max_position_embeddings=256,
                                    extra_config={"sliding_window": WINDOW})
    loras = {"a": str(make_peft_adapter(llama, root / "a", 1, r=8, lora_alpha=24,
                                        target_modules=LORA_TARGETS)),
             "b": str(make_peft_adapter(llama, root / "b", 2, r=4, lora_alpha=8,
                                        target_modules=["q_proj", "v_proj", "o_proj"]))}
    return {"llama": llama, "mistral": mistral, "loras": loras}


# ---- requests -------------------------------------------------------------------------------
def make_requests(seed: int, num: int, max_tokens: int, *, lora: bool = False, n: bool = False,
                  seeded: bool = False, priority: bool = False, abort: bool = False) -> list[dict]:
    """`num` requests: half share a prefix, some repeat a phrase (n-gram drafts find
    matches), the rest random; arrivals staggered over the first steps."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(rng.choice([8, 12, 17]))]
    phrase = [rng.randrange(3, VOCAB) for _ in range(4)]
    reqs = []
    for i in range(num):
        kind = i % 4
        if kind in (0, 1):
            prompt = shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 9))]
        elif kind == 2:
            prompt = phrase * rng.randint(2, 4)
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        count = rng.choice([1, 2, 3]) if n else 1
        tokens = rng.randint(max_tokens // 2, max_tokens)
        if seeded and count > 1:
            params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=rng.randrange(999),
                                    n=count, ignore_eos=True, logprobs=0)
        else:
            params = SamplingParams(max_tokens=tokens, temperature=0.0, n=count,
                                    ignore_eos=True, logprobs=0)
        arrive = rng.choice([0, 0, 0, 1, 2, 4])
        reqs.append(dict(prompt=prompt, params=params, arrive=arrive,
                         lora=rng.choice([None, "a", "b"]) if lora else None,
                         priority=rng.choice([0, 1, 2]) if priority else 0,
                         abort=arrive + rng.choice([2, 5]) if abort and i % 3 == 1 else None))
    return reqs


def run_alone(engine: LLMEngine, reqs: list[dict]) -> dict:
    outputs = {}
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", r["prompt"], r["params"], lora_name=r["lora"])
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    return outputs


def run_mixed(engine: LLMEngine, reqs: list[dict], checker: KVContentChecker) -> dict:
    """Add each request at its arrival step, abort at its abort step; step until done."""
    outputs = run_with_arrivals(engine, reqs, max_steps=2000)
    assert checker.num_checked > 0
    return outputs


class KVContentChecker:
    """Tracks what each KV slot holds (the hash of the token prefix whose last K/V it is,
    salted by adapter) as the runner writes it, and asserts before every step that every
    slot a scheduled sequence reads holds that sequence's own prefix."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.slots: dict[int, int] = {}
        self.num_checked = 0
        runner = engine.runner
        original = runner.execute

        def execute(sched):  # noqa: ANN001, ANN202
            self.check_and_record(sched)
            return original(sched)

        runner.execute = execute

    def check_and_record(self, sched) -> None:  # noqa: ANN001
        kv = self.engine.kv_cache
        bs = kv.block_size
        null = kv.pool.null_block
        for sr in sched.scheduled:
            req = sr.request
            blocks = kv.req_to_blocks[req.request_id]
            salt = None if req.lora is None else id(req.lora)
            start = req.num_computed_tokens
            # Positions a query of this step may read; behind a sliding window only the last
            # WINDOW - 1 keys before `start` (released entries are the null block).
            first = 0 if kv.sliding_window is None else max(0, start - kv.sliding_window + 1)
            for p in range(first, start):
                block = blocks[p // bs]
                assert block is not null, (req, p)
                want = hash((salt, tuple(req.token_ids[: p + 1])))
                assert self.slots.get(block.block_id * bs + p % bs) == want, (
                    f"{req.request_id} reads position {p} of block {block.block_id}: not its K/V")
                self.num_checked += 1
            fed = (req.token_ids[start : start + sr.num_new_tokens - sr.num_spec_tokens]
                   + req.spec_token_ids[: sr.num_spec_tokens])
            prefix = req.token_ids[:start]
            for j in range(len(fed)):
                p = start + j
                block = blocks[p // bs]
                self.slots[block.block_id * bs + p % bs] = hash((salt, tuple(prefix + fed[: j + 1])))


def sequences(out) -> list[tuple[list[int], list[float]]]:  # noqa: ANN001
    return [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in out.outputs]


# ---- the matrix -----------------------------------------------------------------------------
# name -> (model, engine options, request options, what must have happened)
# "blocks": the KV pool in blocks (tiny: forces preemption); "budget": max_num_batched_tokens.
CASES = {
    "prefix+chunked+preempt": (
        "llama", dict(block_size=4, budget=5, blocks=12),
        dict(seed=1, num=7, max_tokens=12), {"preempt", "hits"}),
    "prefix+priority+seats+abort": (
        "llama", dict(block_size=4, budget=13, blocks=14, max_num_seqs=2),
        dict(seed=2, num=7, max_tokens=10, priority=True, abort=True), {"preempt", "hits", "abort"}),
    "ngram+chunked+preempt+n": (
        "llama", dict(block_size=4, budget=8, blocks=13,
                      speculative={"method": "ngram", "num_speculative_tokens": 3,
                                   "adaptive": False}),
        dict(seed=3, num=6, max_tokens=12, n=True), {"preempt", "hits", "drafts"}),
    "selfdraft+prefix+priority+abort": (
        "llama", dict(block_size=2, budget=8, blocks=22,
                      speculative={"method": "draft", "draft_layers": 1,
                                   "num_speculative_tokens": 3, "adaptive": False}),
        dict(seed=4, num=7, max_tokens=12, priority=True, abort=True),
        {"preempt", "hits", "drafts", "abort"}),
    "int8draft+lora+chunked+preempt": (
        "llama", dict(block_size=4, budget=6, blocks=10, lora=True,
                      speculative={"method": "draft", "quantization": "int8",
                                   "num_speculative_tokens": 2, "adaptive": False}),
        dict(seed=5, num=6, max_tokens=10, lora=True), {"preempt", "drafts"}),
    "lora+prefix+preempt+n": (
        "llama", dict(block_size=4, budget=32, blocks=12, lora=True),
        dict(seed=6, num=7, max_tokens=12, lora=True, n=True), {"preempt", "hits"}),
    "seeded-n+prefix+preempt+priority": (
        "llama", dict(block_size=4, budget=8, blocks=12),
        dict(seed=7, num=6, max_tokens=12, n=True, seeded=True, priority=True),
        {"preempt", "hits"}),
    "window+prefix+chunked+preempt+abort": (
        "mistral", dict(block_size=4, budget=5, blocks=9),
        dict(seed=8, num=7, max_tokens=16, abort=True), {"preempt", "hits", "abort"}),
    "window+selfdraft+prefix+preempt": (
        "mistral", dict(block_size=4, budget=8, blocks=10,
                        speculative={"method": "draft", "draft_layers": 1,
                                     "num_speculative_tokens": 2, "adaptive": False}),
        dict(seed=9, num=6, max_tokens=16), {"preempt", "drafts"}),
    "int8kv+prefix+chunked+preempt+abort": (
        "llama", dict(block_size=4, budget=5, blocks=12, kv_cache_dtype="int8"),
        dict(seed=10, num=7, max_tokens=12, abort=True), {"preempt", "hits", "abort"}),
}

_REFERENCES: dict = {}


def reference(models: dict, model: str, kv_dtype: str, lora: bool, reqs: list[dict]) -> dict:
    """Each request alone on a plain engine (no prefix cache, one step per prompt, a roomy
    pool), cached across cases."""
    key = lambda r: (model, kv_dtype, tuple(r["prompt"]), repr(r["params"]), r["lora"])  # noqa: E731
    missing = [r for r in reqs if key(r) not in _REFERENCES]
    if missing:
        engine = LLMEngine(model=str(models[model]), dtype="float32", kv_cache_dtype=kv_dtype,
                           enable_prefix_caching=False, kv_cache_memory=1 << 20,
                           lora_modules=models["loras"] if lora else None)
        for i, out in run_alone(engine, missing).items():
            _REFERENCES[key(missing[int(i[1:])])] = out
    return {f"r{i}": _REFERENCES[key(r)] for i, r in enumerate(reqs)}


def bytes_per_block(engine_kwargs: dict, block_size: int) -> int:
    # Both tiny models: 2 layers x 2 KV heads x head_dim 16, K and V.
    elems = 2 * 2 * 2 * 16
    if engine_kwargs.get("kv_cache_dtype") == "int8":  # int8 values + a scale per token and head
        size = block_size * (elems + 2 * 2 * 2 * KV_SCALE_DTYPE.itemsize)
    else:
        size = block_size * elems * 4
    speculative = engine_kwargs.get("speculative") or {}
    if speculative.get("quantization") or speculative.get("model"):
        # A separate draft (a copy of the model) has a float32 block of its own per block,
        # from the same budget (spec_decode/draft_cache.py).
        size += block_size * elems * 4
    return size


@pytest.mark.parametrize("case", list(CASES))
def test_feature_combination_matches_one_at_a_time(case: str, models: dict) -> None:
    model, options, request_options, engaged = CASES[case]
    options = dict(options)
    block_size, budget, blocks = (options.pop(k) for k in ("block_size", "budget", "blocks"))
    lora = options.pop("lora", False)
    kv_dtype = options.get("kv_cache_dtype", "auto")
    reqs = make_requests(**request_options)
    expected = reference(models, model, kv_dtype, lora, reqs)

    engine = LLMEngine(model=str(models[model]), dtype="float32", block_size=block_size,
                       max_num_batched_tokens=budget,
                       kv_cache_memory=blocks * bytes_per_block(options, block_size),
                       lora_modules=models["loras"] if lora else None, **options)
    assert engine.kv_cache.num_blocks == blocks - (model == "mistral")  # (the null block)
    checker = KVContentChecker(engine)
    got = run_mixed(engine, reqs, checker)
    assert_no_leaks(engine)

    num_aborted = 0
    for i, r in enumerate(reqs):
        out = got.get(f"r{i}")
        if out is None:  # aborted before its first token
            assert r["abort"] is not None
            num_aborted += 1
            continue
        aborted = not out.finished  # its last output before abort_request
        assert not aborted or r["abort"] is not None
        num_aborted += aborted
        want = sequences(expected[f"r{i}"])
        for j, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
                zip(sequences(out), want, strict=True)):
            if aborted:
                assert tokens == ref_tokens[: len(tokens)], (case, i, j)
            else:
                assert tokens == ref_tokens, (case, i, j, r["prompt"])
            for a, b in zip(logprobs, ref_logprobs):
                assert abs(a - b) < LOGPROB_TOL[kv_dtype], (case, i, j, a, b)

    stats = engine.get_stats()
    happened = {"preempt": stats.num_preemptions > 0, "hits": stats.prefix_cache_hits > 0,
                "drafts": stats.spec_decode_num_draft_tokens > 0, "abort": num_aborted > 0}
    assert {k for k in engaged if not happened[k]} == set(), (case, happened)
