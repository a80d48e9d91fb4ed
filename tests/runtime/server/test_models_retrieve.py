"""`GET /v1/models/{model}` (the openai client's `models.retrieve`) against a real `argosy serve`:
the same object `/v1/models` lists for the served name (here one with a slash, which the client
sends as %2F), a loaded adapter and one registered but not loaded (--max-cpu-loras 1), one added
over HTTP; an unknown or unloaded name is the 404 `model_not_found` a request naming it gets."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_api import PROMPT, peft_model  # noqa: E402, F401  (fixture)

pytestmark = pytest.mark.slow  # starts an `argosy serve` process

SERVED = "org/smollm2"


@pytest.fixture(scope="module")
def server(peft_model) -> Iterator[ServerProcess]:  # noqa: F811
    folder = peft_model[0]
    proc = ServerProcess("--served-model-name", SERVED, "--max-cpu-loras", "1",
                         "--allow-runtime-lora-updates",
                         "--lora-modules", f"colors={folder},hues={folder}")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_retrieve_returns_the_listed_model_object(server: ServerProcess, peft_model) -> None:  # noqa: F811
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    client.completions.create(model="colors", prompt=PROMPT, max_tokens=1)  # loads "colors"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        resp = http.post("/v1/load_lora_adapter",
                         json={"lora_name": "shades", "lora_path": str(peft_model[0])})
        assert resp.status_code == 200, resp.text
        loaded = http.get("/metrics").text
    # One slot: "colors" is loaded, "hues" and "shades" only registered.
    assert 'argosy:lora_adapter_loaded{lora_name="colors"' in loaded
    assert 'argosy:lora_adapter_loaded{lora_name="hues"' not in loaded

    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(listed) == {SERVED, "colors", "hues", "shades"}
    for name, card in listed.items():
        assert client.models.retrieve(name).model_dump() == card, name
    base = client.models.retrieve(SERVED)
    assert (base.id, base.object, base.owned_by) == (SERVED, "model", "argosy")
    assert base.model_extra["max_model_len"] == 2048 and base.model_extra["parent"] is None
    assert client.models.retrieve("hues").model_extra["parent"] == SERVED

    with pytest.raises(NotFoundError) as unknown:
        client.models.retrieve("smollm2")
    assert unknown.value.code == "model_not_found"
    assert unknown.value.body == {
        "message": f"model 'smollm2' does not exist; this server serves '{SERVED}', 'colors', "
                   "'hues', 'shades'",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}

    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "shades"}).status_code == 200
        # A trailing slash names no model; the raw body is the OpenAI error object.
        empty = http.get("/v1/models/")
        assert empty.status_code == 404
        assert empty.json()["error"]["code"] == "model_not_found"
        metrics = http.get("/metrics").text
    with pytest.raises(NotFoundError, match="'shades' does not exist"):
        client.models.retrieve("shades")
    # Requests are counted under the route, never under a model id.
    assert 'path="/v1/models/{id}",status="200"' in metrics
    assert 'path="/v1/models/{id}",status="404"' in metrics
