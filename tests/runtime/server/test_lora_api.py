"""LoRA adapters over HTTP: `argosy serve --lora-modules` with a PEFT adapter of the embedded
SmolLM2; the official `openai` client picks it by model name, and its greedy text equals PEFT +
transformers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import NotFoundError, OpenAI
from serve_harness import MODEL, ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import embedded_gguf_path  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory):
    """(adapter folder, the PEFT model it came from) on the embedded model's weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    base = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    folder = tmp_path_factory.mktemp("lora") / "colors"
    model.save_pretrained(str(folder))
    return folder, model.eval()


@pytest.fixture(scope="module")
def lora_server(peft_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the adapter as `colors`, runtime updates on, and a modules file (empty)."""
    modules_file = tmp_path_factory.mktemp("modules") / "adapters.json"
    modules_file.write_text("{}")
    proc = ServerProcess("--lora-modules", f"colors={peft_model[0]}",
                         "--allow-runtime-lora-updates", "--lora-modules-file", str(modules_file))
    proc.modules_file = modules_file  # type: ignore[attr-defined]
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def lora_client(lora_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@torch.no_grad()
def peft_greedy_text(model, tokenizer, adapter: bool, max_tokens: int) -> str:
    ids = tokenizer.encode(PROMPT)
    if adapter:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    else:
        with model.disable_adapter():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist())


def test_adapter_by_model_name_equals_peft(lora_client: OpenAI, peft_model) -> None:
    from argosy_runtime.model_loader import load_checkpoint

    tokenizer = load_checkpoint(MODEL).tokenizer
    models = {m.id: m for m in lora_client.models.list().data}
    assert set(models) == {MODEL, "colors"}
    assert models["colors"].model_extra["parent"] == MODEL

    lora = lora_client.completions.create(model="colors", prompt=PROMPT, max_tokens=12,
                                          temperature=0)
    base = lora_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          temperature=0)
    assert lora.model == "colors" and base.model == MODEL
    assert lora.choices[0].text == peft_greedy_text(peft_model[1], tokenizer, True, 12)
    assert base.choices[0].text == peft_greedy_text(peft_model[1], tokenizer, False, 12)
    assert lora.choices[0].text != base.choices[0].text

    chat = lora_client.chat.completions.create(
        model="colors", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)

    with pytest.raises(NotFoundError):
        lora_client.completions.create(model="colours", prompt=PROMPT, max_tokens=1)


def _greedy(client: OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text


def test_adapters_load_and_unload_over_http(lora_server: ServerProcess, lora_client: OpenAI,
                                            peft_model) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with no restart."""
    folder = str(peft_model[0])
    expected = _greedy(lora_client, "colors")
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        resp = http.post("/v1/load_lora_adapter", json={"lora_name": "hues", "lora_path": folder})
        assert resp.status_code == 200, resp.text
        assert resp.text == "Success: LoRA adapter 'hues' added successfully."
        assert {m.id for m in lora_client.models.list().data} == {MODEL, "colors", "hues"}
        assert _greedy(lora_client, "hues") == expected
        # The gateway routes an adapter's requests by this series (gateway/health.py).
        metrics = http.get("/metrics").text
        assert f'argosy:lora_adapter_loaded{{lora_name="hues",model_name="{MODEL}"}} 1.0' in metrics
        errors = [
            ({"lora_name": "hues", "lora_path": folder}, 400, "has already been loaded"),
            ({"lora_name": "nope", "lora_path": "/no/such/dir"}, 400, "adapter_config.json"),
            ({"lora_name": MODEL, "lora_path": folder}, 400, "not a usable adapter name"),
            ({"lora_name": "x"}, 400, "lora_path"),
        ]
        for body, status, message in errors:
            resp = http.post("/v1/load_lora_adapter", json=body)
            assert resp.status_code == status and message in resp.json()["error"]["message"], (
                body, resp.text)
        resp = http.post("/v1/unload_lora_adapter", json={"lora_name": "hues"})
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'hues' removed successfully."
        with pytest.raises(NotFoundError):
            lora_client.completions.create(model="hues", prompt=PROMPT, max_tokens=1)
        resp = http.post("/v1/unload_lora_adapter", json={"lora_name": "hues"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert _greedy(lora_client, "colors") == expected  # the others never noticed


def test_modules_file_adds_and_removes_adapters_while_serving(
        lora_server: ServerProcess, lora_client: OpenAI, peft_model) -> None:
    """--lora-modules-file (what the operator's ConfigMap holds) is applied while serving."""
    from argosy_runtime.lora.modules_file import POLL_SECONDS

    def served() -> set[str]:
        return {m.id for m in lora_client.models.list().data}

    def wait_until(check, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 2 * POLL_SECONDS + 10
        while not check():
            assert time.monotonic() < deadline, f"timed out: {what}"
            time.sleep(0.25)

    expected = _greedy(lora_client, "colors")
    path = lora_server.modules_file  # type: ignore[attr-defined]
    path.write_text(json.dumps({"filed": str(peft_model[0]), "broken": "/no/such/adapter"}))
    wait_until(lambda: "filed" in served(), "the file's adapter to be served")
    assert _greedy(lora_client, "filed") == expected
    assert "broken" not in served()  # logged and skipped; the rest is served
    wait_until(lambda: "LoRA adapter broken from" in lora_server.log_text(), "the error log")
    path.write_text("{}")
    wait_until(lambda: "filed" not in served(), "the adapter removed from the file to go")
    assert served() == {MODEL, "colors"}  # --lora-modules ones are not the file's to remove
