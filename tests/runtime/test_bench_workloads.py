"""The workloads the benchmarks send: prompts of the stated length, no prompt reused where a
prefix cache would turn it into a cache hit, and no run dropped when results are merged."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
from argosy_runtime.benchmarks import offline, serve
from argosy_runtime.benchmarks.serve import WORDS, make_requests, rate_seed


@pytest.mark.parametrize("prefix_len", [None, 0, 47, 100])
def test_shared_prefix_prompts_are_input_len_words(prefix_len: int | None) -> None:
    specs = make_requests("shared-prefix", 300, 48, 4, seed=5, prefix_len=prefix_len)
    for spec in specs:
        words = spec.prompt.split()
        # words of WORDS only: a number such as " 12" is 3 tokens in SmolLM2's tokenizer
        assert len(words) == 48 and set(words) <= set(WORDS), spec.prompt
    assert len({s.prompt for s in specs}) == len(specs)
    plen = min(46, 36 if prefix_len is None else prefix_len)  # 300 prompts: 2 words tell apart
    assert len({" ".join(s.prompt.split()[:plen]) for s in specs}) == 1


def test_prompts_are_input_len_tokens_of_the_embedded_model() -> None:
    from argosy_runtime.model_loader.load import load_checkpoint

    tokenizer = load_checkpoint("smollm2-135m").tokenizer
    # A prompt's first word has no space before it: "spell" was 2 tokens there.
    for word in WORDS:
        assert len(tokenizer.encode(word)) == 1 and len(tokenizer.encode(" " + word)) == 1, word
    for dataset in ("synthetic", "synthetic-mixed", "shared-prefix"):
        for i in range(3):
            for spec in make_requests(dataset, 48, 64, 4, seed=rate_seed(0, i)):
                assert len(tokenizer.encode(spec.prompt)) == len(spec.prompt.split())
                if dataset != "synthetic-mixed":
                    assert len(spec.prompt.split()) == 64


def test_compare_keeps_runs_that_share_a_label(tmp_path: Path) -> None:
    """The default label is the served model's name, the same for ours and vLLM's when both
    serve one model: merging must keep both runs, not the last file's alone."""
    paths = []
    for name, tok_s in (("ours", 100.0), ("vllm", 50.0)):
        path = tmp_path / f"{name}.json"
        row = {"rate": 1.0, "output_tokens_per_s": tok_s, "samples": {"ttft": [], "itl": [],
                                                                       "e2e": []}}
        path.write_text(json.dumps({"config": {}, "runs": {"smollm2-135m": [row]}}))
        paths.append(str(path))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    merged = tmp_path / "merged.json"
    assert serve.run(parser.parse_args(["--compare", *paths, "--json", str(merged)])) == 0
    runs = json.loads(merged.read_text())["runs"]
    assert sorted(r[0]["output_tokens_per_s"] for r in runs.values()) == [50.0, 100.0]


def test_offline_batches_share_no_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps its prefix cache across generate() calls: a prompt of an earlier batch (or
    of the warm-up) sent again would be prefilled from the cache, in vLLM's favour."""
    sent: list[dict] = []

    def fake_run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        if cmd[1:] == ["-c", "import vllm"]:
            return subprocess.CompletedProcess(cmd, 0, "", "")
        cfg = json.loads(cmd[-1])
        sent.append(cfg)
        result = {b: 1.0 for b in cfg["batches"]}
        return subprocess.CompletedProcess(cmd, 0, "RESULT " + json.dumps(result), "")

    monkeypatch.setattr(offline.subprocess, "run", fake_run)
    args = argparse.Namespace(vllm_python="python", model="smollm2-135m", dtype="bfloat16",
                              output_len=4, input_len=32, seed=0)
    assert offline.run_vllm(args, [1, 8, 32], vocab=49152) == {1: 1.0, 8: 1.0, 32: 1.0}
    cfg = sent[0]
    prompts = [p for b in ("1", "8", "32") for p in cfg["batches"][b]] + cfg["warmup"]
    assert len(prompts) == 1 + 8 + 32 + 2
    # vLLM caches whole blocks: no two prompts may share even their first 16 tokens
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)
    assert all(len(p) == 32 for b in ("1", "8", "32") for p in cfg["batches"][b])
