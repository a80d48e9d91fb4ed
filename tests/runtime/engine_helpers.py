"""Helpers shared by engine-level tests (import with tests/runtime on sys.path)."""

from __future__ import annotations

from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.models.cpu_decode import CpuDecodeLayers


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block is back in the pool (cached-free counts as free), no block table left."""
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, (kv.num_free_blocks, kv.num_blocks)
    assert kv.req_to_blocks == {}


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    """(token ids, the logprob of each) of a RequestOutput's first sequence: what the
    batch-invariant mode must reproduce bit for bit."""
    c = output.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def run_requests(engine: LLMEngine, requests: list[tuple[list[int] | str, SamplingParams]]
                 ) -> list:
    """Add (prompt, params) pairs as r0, r1, ... together; step until all finish. Their final
    RequestOutputs, in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(requests))]


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                      abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Add prompts as r0, r1, ...; step until done, aborting `{request_id: at_step}`.
    Returns the output token ids of every request that finished."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(rid)
    return done


def record_cpp_layer_calls(monkeypatch) -> list[int]:  # noqa: ANN001
    """From now on, the row count of every step that runs the C++ decode layers
    (CpuDecodeLayers), for tests that must prove the C++ path ran or did not."""
    calls: list[int] = []
    original = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__",
                        lambda self, h, *args: calls.append(h.shape[0]) or original(self, h, *args))
    return calls
