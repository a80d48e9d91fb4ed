"""LoRA adapters over HTTP: `argosy serve --lora-modules` with a PEFT adapter of the embedded
SmolLM2; the official `openai` client picks it by model name, and its greedy text equals PEFT +
transformers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

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
def lora_client(peft_model) -> Iterator[OpenAI]:
    proc = ServerProcess("--lora-modules", f"colors={peft_model[0]}")
    try:
        proc.wait_ready()
        yield OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        proc.stop()


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
