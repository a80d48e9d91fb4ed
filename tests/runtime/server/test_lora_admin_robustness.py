"""`POST /v1/load_lora_adapter` / `unload_lora_adapter` with broken adapters and while requests
run, on real `argosy serve` processes (eager, and `--max-loaded-loras`): a malformed adapter
is a 400 naming it, never a 500; unloading an adapter a stream is using lets the stream finish
on it (same text, every KV block freed) and later requests get a 404."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from serve_harness import MODEL, ServerProcess

sys.path.insert(0, str(Path(__file__).parent))

from test_lora_api import PROMPT, peft_greedy_text, peft_model  # noqa: E402, F401

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

MAX_TOKENS = 48  # long enough that the stream still runs when its adapter is unloaded


@pytest.fixture(scope="module")
def broken(peft_model, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> dict[str, str]:
    """Copies of the good adapter, each broken one way."""
    tmp = tmp_path_factory.mktemp("broken")

    def variant(name: str, file: str, data: bytes) -> str:
        folder = tmp / name
        shutil.copytree(peft_model[0], folder)
        (folder / file).write_bytes(data)
        return str(folder)

    config = json.loads((peft_model[0] / "adapter_config.json").read_text())
    return {
        "list-config": variant("list-config", "adapter_config.json", b"[]"),
        "rank-zero": variant("rank-zero", "adapter_config.json",
                             json.dumps({**config, "r": 0}).encode()),
        "garbage-weights": variant("garbage-weights", "adapter_model.safetensors",
                                   b"not safetensors" * 8),
        "nested-config": variant("nested-config", "adapter_config.json",
                                 b"[" * 100_000 + b"]" * 100_000),
    }


@pytest.fixture(scope="module")
def eager_server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--allow-runtime-lora-updates")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def lazy_server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--allow-runtime-lora-updates", "--max-loaded-loras", "1")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_broken_adapters_are_400s_naming_them(eager_server: ServerProcess, broken) -> None:
    """A config that is not an object, r = 0 and unreadable weights used to be 500s (an
    AttributeError, a ZeroDivisionError, a SafetensorError out of the loader), and so was a
    config nested too deeply for json (a RecursionError)."""
    expected = {"list-config": "is not a JSON object",
                "rank-zero": "'r' must be a positive integer, not 0",
                "garbage-weights": "cannot read",
                "nested-config": "nested too deeply"}
    with httpx.Client(base_url=eager_server.url, timeout=60) as http:
        for name, path in broken.items():
            resp = _load(http, name, path)
            assert resp.status_code == 400, (name, resp.text)
            error = resp.json()["error"]
            assert error["message"].startswith(f"LoRA adapter {name!r}: "), error
            assert expected[name] in error["message"] and error["param"] == "lora_path", error
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {MODEL}


def test_the_base_models_name_is_refused_as_a_lora_name_error(eager_server: ServerProcess,
                                                               peft_model) -> None:  # noqa: F811
    with httpx.Client(base_url=eager_server.url, timeout=60) as http:
        resp = _load(http, MODEL, str(peft_model[0]))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "not a usable adapter name" in error["message"] and error["param"] == "lora_name"


def test_unloading_an_adapter_a_stream_uses_lets_it_finish(eager_server: ServerProcess,
                                                           peft_model) -> None:  # noqa: F811
    """The stream keeps the adapter it started with to its last token (the same text as
    PEFT), its KV blocks are freed, and the next request for the name is a 404. One path
    loaded under two names serves both; loading while a stream runs disturbs nothing."""
    from argosy_runtime.model_loader import load_checkpoint

    tokenizer = load_checkpoint(MODEL).tokenizer
    expected = peft_greedy_text(peft_model[1], tokenizer, True, MAX_TOKENS)
    client = OpenAI(base_url=eager_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=120)
    with httpx.Client(base_url=eager_server.url, timeout=60) as http:
        for name in ("mid", "twin"):  # the same folder twice
            assert _load(http, name, str(peft_model[0])).status_code == 200
        idle_kv = eager_server.running_and_kv()[1]
        stream = client.completions.create(model="mid", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        chunks = iter(stream)
        text = next(chunks).choices[0].text  # running now, holding the adapter
        resp = http.post("/v1/unload_lora_adapter", json={"lora_name": "mid"})
        assert resp.status_code == 200, resp.text
        assert eager_server.running_and_kv()[0] == 1  # unloaded while the stream runs
        assert _load(http, "late", str(peft_model[0])).status_code == 200
        text += "".join(c.choices[0].text for c in chunks)
        assert text == expected
        eager_server.assert_back_to_idle(idle_kv, within=10)
        with pytest.raises(NotFoundError) as err:
            client.completions.create(model="mid", prompt=PROMPT, max_tokens=1)
        assert err.value.body["code"] == "model_not_found"
        for name in ("twin", "late"):
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0)
            assert out.choices[0].text == expected, name
        for name in ("twin", "late"):
            assert http.post("/v1/unload_lora_adapter",
                             json={"lora_name": name}).status_code == 200


def test_lazy_server_refuses_a_bad_rank_and_fails_bad_weights_with_400s(
        lazy_server: ServerProcess, broken, peft_model) -> None:  # noqa: F811
    """--max-loaded-loras registers from the config alone: r = 0 used to register and then
    fail every request naming it with a 500; weights that are not safetensors register (they
    are read at first use) and now fail each request with a 400 naming the adapter."""
    from argosy_runtime.model_loader import load_checkpoint

    client = OpenAI(base_url=lazy_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=120)
    with httpx.Client(base_url=lazy_server.url, timeout=60) as http:
        resp = _load(http, "rank-zero", broken["rank-zero"])
        assert resp.status_code == 400 and "'r' must be a positive integer" in resp.text
        assert _load(http, "garbage", broken["garbage-weights"]).status_code == 200
        assert _load(http, "good", str(peft_model[0])).status_code == 200
    for _ in range(2):  # nothing kept from a failed load: tried again, failed again
        with pytest.raises(BadRequestError, match="LoRA adapter 'garbage': cannot read"):
            client.completions.create(model="garbage", prompt=PROMPT, max_tokens=1)
    expected = peft_greedy_text(peft_model[1], load_checkpoint(MODEL).tokenizer, True, 8)
    out = client.completions.create(model="good", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected


def test_a_request_waiting_for_an_adapter_unloaded_meanwhile_is_a_404(
        lazy_server: ServerProcess, peft_model) -> None:  # noqa: F811
    """--max-loaded-loras 1: a request for a second adapter waits while a stream holds the
    only slot; unloading its adapter meanwhile answers it as any request naming an adapter
    the server does not serve: 404 model_not_found."""
    import threading

    client = OpenAI(base_url=lazy_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=120)
    with httpx.Client(base_url=lazy_server.url, timeout=60) as http:
        for name in ("holder", "waiter"):
            assert _load(http, name, str(peft_model[0])).status_code == 200
        # 160 tokens: seconds of decoding, far longer than the waiter takes to queue.
        stream = client.completions.create(model="holder", prompt=PROMPT, max_tokens=160,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # running: "holder" holds the only slot
        errors: list[BaseException] = []

        def wait_for_waiter() -> None:
            try:
                client.completions.create(model="waiter", prompt=PROMPT, max_tokens=1)
            except BaseException as exc:  # noqa: BLE001 (checked below)
                errors.append(exc)

        thread = threading.Thread(target=wait_for_waiter)
        thread.start()
        while lazy_server.metrics()["argosy:num_requests_waiting"] < 1:
            pass
        assert lazy_server.running_and_kv()[0] == 1  # the holder still runs
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "waiter"}).status_code == 200
        thread.join(60)
        assert len(errors) == 1 and isinstance(errors[0], NotFoundError), errors
        assert errors[0].body["code"] == "model_not_found"
        finish = [c.choices[0].finish_reason for c in chunks][-1]
        assert finish == "length"  # the holder never noticed
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "holder"}).status_code == 200


def test_a_response_on_an_adapter_unloaded_while_it_runs_is_still_answered(
        eager_server: ServerProcess, peft_model) -> None:  # noqa: F811
    """Unloading an adapter lets the requests already running on it finish on it, and so a
    non-streamed /v1/responses answer on it comes back (200, its model the adapter's name).
    The Responses route checked the model name a second time after generating, and answered
    the finished response with a 404 model_not_found."""
    import threading

    client = OpenAI(base_url=eager_server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=120)
    with httpx.Client(base_url=eager_server.url, timeout=60) as http:
        assert _load(http, "respond", str(peft_model[0])).status_code == 200
        idle_kv = eager_server.running_and_kv()[1]
        result: list[object] = []

        def respond() -> None:
            try:  # 160 tokens: seconds of decoding, far longer than the unload takes
                result.append(client.responses.create(
                    model="respond", input=PROMPT, max_output_tokens=160, temperature=0,
                    extra_body={"ignore_eos": True}))
            except BaseException as exc:  # noqa: BLE001 (checked below)
                result.append(exc)

        thread = threading.Thread(target=respond)
        thread.start()
        while eager_server.running_and_kv()[0] < 1:
            assert thread.is_alive(), result
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "respond"}).status_code == 200
        thread.join(120)
        assert len(result) == 1 and not isinstance(result[0], BaseException), result
        response = result[0]
        assert response.model == "respond" and response.status == "incomplete"
        assert response.usage.output_tokens == 160
        eager_server.assert_back_to_idle(idle_kv, within=10)
