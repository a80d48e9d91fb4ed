"""`argosy serve --tensor-parallel-size 3`: a live server over three ranks (this process's
workers are real processes) answers like the one-process engine, and SIGTERM stops them all."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from argosy_runtime import SamplingParams
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from process_helpers import is_running  # noqa: E402

pytestmark = pytest.mark.slow  # starts an `argosy serve` process with two workers

PROMPT = "The three primary colors are"


def worker_pids(parent: int) -> list[int]:
    """The tensor-parallel workers of process `parent`: its spawned multiprocessing children."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="module")
def tp_server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--tensor-parallel-size", "3", "--drain-timeout", "5")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_completions_equal_the_one_process_engine(tp_server: ServerProcess, offline_llm) -> None:
    import openai

    client = openai.OpenAI(base_url=tp_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    expected = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0]
    text = expected.outputs[0].text
    got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16,
                                    temperature=0)
    assert got.choices[0].text == text
    stream = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    assert "tensor_parallel=3" in tp_server.log_text()


def test_sigterm_stops_the_workers_too(tp_server: ServerProcess) -> None:
    workers = worker_pids(tp_server.proc.pid)
    assert len(workers) == 2, workers
    assert tp_server.stop() == 0
    deadline = time.monotonic() + 15
    while any(is_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(is_running(pid) for pid in workers), tp_server.log_text()[-2000:]
    assert "tensor-parallel workers stopped" in tp_server.log_text()
