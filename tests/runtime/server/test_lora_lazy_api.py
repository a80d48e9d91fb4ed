"""`argosy serve --max-cpu-loras 1` (alias of --max-loaded-loras): adapters are listed and
routable before they are loaded, the first requests load one (once), at most one is in memory,
requests for another wait instead of failing, a broken adapter is a 400 that leaves the others
serving, and `/metrics` tells loaded from registered adapters."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI
from serve_harness import MODEL, ServerProcess

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_api import PROMPT, peft_greedy_text, peft_model  # noqa: E402, F401

pytestmark = pytest.mark.slow  # starts an `argosy serve` process


@pytest.fixture(scope="module")
def lazy_server(peft_model, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
                ) -> Iterator[ServerProcess]:
    from safetensors.torch import load_file, save_file

    folder = peft_model[0]
    bad = tmp_path_factory.mktemp("bad") / "bad"
    shutil.copytree(folder, bad)  # a config that registers, weights that do not fit
    weights = bad / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(weights))
    proc = ServerProcess("--max-cpu-loras", "1", "--allow-runtime-lora-updates",
                         "--lora-modules", f"colors={folder},hues={folder},bad={bad}")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def adapter_series(server: ServerProcess, family: str) -> set[str]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return set(re.findall(rf'^argosy:{family}{{lora_name="([^"]+)",model_name="{MODEL}"}} 1\.0$',
                          text, re.MULTILINE))


def adapter_loads(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(rf'^argosy:lora_adapter_loads_total{{model_name="{MODEL}"}} (\S+)$',
                           text, re.MULTILINE).group(1))


def test_adapters_load_on_first_use_one_at_a_time(lazy_server: ServerProcess,
                                                  peft_model) -> None:  # noqa: F811
    from argosy_runtime.model_loader import load_checkpoint

    client = OpenAI(base_url=lazy_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=120)
    expected = peft_greedy_text(peft_model[1], load_checkpoint(MODEL).tokenizer, True, 8)
    assert {m.id for m in client.models.list().data} == {MODEL, "colors", "hues", "bad"}
    assert adapter_series(lazy_server, "lora_adapter_registered") == {"colors", "hues", "bad"}
    assert adapter_series(lazy_server, "lora_adapter_loaded") == set()

    def greedy(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                         temperature=0).choices[0].text

    # Concurrent first requests share one load.
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(greedy, ["colors"] * 6)) == [expected] * 6
    assert lazy_server.log_text().count("LoRA adapter colors loaded on demand") == 1
    assert adapter_series(lazy_server, "lora_adapter_loaded") == {"colors"}
    assert adapter_loads(lazy_server) == 1

    # Two adapters, one slot: requests for the second wait for the first's to finish.
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(greedy, ["hues", "colors"] * 3)) == [expected] * 6
    assert len(adapter_series(lazy_server, "lora_adapter_loaded")) == 1
    assert "evicted (least recently used" in lazy_server.log_text()
    # Every load counted, reloads after an eviction too.
    assert adapter_loads(lazy_server) == lazy_server.log_text().count("loaded on demand") >= 2

    # A broken adapter: a 400 naming the problem, to each request, and the rest still serve.
    for _ in range(2):
        with pytest.raises(BadRequestError, match="LoRA adapter 'bad': layer .* has shapes"):
            greedy("bad")
    assert lazy_server.log_text().count("LoRA adapter bad: load failed") == 2  # retried
    assert greedy("hues") == expected
    assert adapter_series(lazy_server, "lora_adapter_loaded") == {"hues"}

    # Registering over HTTP checks the config (no weights read) and lists the adapter.
    with httpx.Client(base_url=lazy_server.url, timeout=60) as http:
        resp = http.post("/v1/load_lora_adapter",
                         json={"lora_name": "late", "lora_path": str(peft_model[0])})
        assert resp.status_code == 200, resp.text
        dora = Path(lazy_server.log_path).with_suffix(".dora")
        shutil.copytree(peft_model[0], dora)
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        resp = http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(dora)})
        assert resp.status_code == 400 and "use_dora" in resp.json()["error"]["message"]
        shutil.rmtree(dora)
    assert "late" in {m.id for m in client.models.list().data}
    assert "late" in adapter_series(lazy_server, "lora_adapter_registered")
    assert "late" not in adapter_series(lazy_server, "lora_adapter_loaded")
    assert greedy("late") == expected
