"""`argosy serve --batch-invariant` over real HTTP with the official openai client: a request
gets the same tokens and logprobs alone and among concurrent requests; a configuration the
mode cannot honour stops the server at startup with the reason."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from argosy_kernels import cpu_ops
from serve_harness import ServerProcess

pytestmark = pytest.mark.skipif(not cpu_ops.has_avx512_bf16(),
                                reason="the batch-invariant mode needs AVX512-BF16")

PROMPT = "Explain in two sentences why the sky is blue:"
OTHERS = ["Write a haiku about autumn leaves.", "def quicksort(items):",
          "The three largest cities in Japan are", "Once upon a time, in a small village,",
          "SELECT name FROM users WHERE", "Translate 'thank you very much' into German:"]


def test_same_answer_alone_and_under_concurrent_load() -> None:
    import openai

    server = ServerProcess("--dtype", "bfloat16", "--batch-invariant").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def complete(prompt: str):
            choice = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24,
                                               temperature=0, logprobs=1,
                                               extra_body={"ignore_eos": True}).choices[0]
            return choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs

        alone = complete(PROMPT)
        with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
            futures = [pool.submit(complete, p) for p in OTHERS[:3]]
            target = pool.submit(complete, PROMPT)
            futures += [pool.submit(complete, p) for p in OTHERS[3:]]
            busy = target.result()
            for f in futures:
                f.result()
        assert busy == alone
        assert "batch_invariant=True" in server.log_text()
    finally:
        assert server.stop() == 0


def test_refused_configuration_stops_at_startup() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "argosy_runtime.cli.main", "serve", "--model", "smollm2-135m",
         "--batch-invariant", "--dtype", "float32", "--port", "0"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "batch_invariant (--batch-invariant) cannot be honoured: dtype float32" in (
        result.stdout + result.stderr)
