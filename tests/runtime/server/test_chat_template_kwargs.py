"""vLLM's `chat_template_kwargs` (chat completions and /tokenize) reach the chat template, on a
real `argosy serve` of a tiny model whose template reads `enable_thinking` as Qwen3's does."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_random_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

# Qwen3's switch, reduced to what it does to the prompt: an empty think block when off.
# Refusing a system message with `raise_exception`, as Gemma's and Mistral's templates refuse
# what they cannot render.
# `keep_last` is a template variable of this test's own: the last k messages. An assistant
# turn's `reasoning_content` is shown, as Qwen3's template shows it after the last user turn.
TEMPLATE = (
    "{% if keep_last is defined %}{% set messages = messages[-keep_last:] %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = make_random_model_dir(tmp_path_factory.mktemp("models"), "llama")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    proc = ServerProcess("--model", str(folder), "--served-model-name", "tiny")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _prompt(server: ServerProcess, **body) -> str:  # noqa: ANN003
    resp = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return httpx.post(server.url + "/detokenize", json={"tokens": resp.json()["tokens"]},
                      timeout=60).json()["prompt"]


def test_template_variables_reach_the_template(server: ServerProcess) -> None:
    assert "<think>" not in _prompt(server)
    assert "<think>" not in _prompt(server, chat_template_kwargs={"enable_thinking": True})
    assert _prompt(server, chat_template_kwargs={"enable_thinking": False}).endswith(
        "assistant\n<think>\n\n</think>\n\n")


def test_an_assistant_turns_reasoning_reaches_the_template(server: ServerProcess) -> None:
    # Qwen3's template shows the thinking of the turns after the last user message (a tool
    # call's reasoning, then its result): vLLM passes it on; it was dropped.
    messages = [*MESSAGES, {"role": "assistant", "content": "", "reasoning_content": "I need a tool",
                            "tool_calls": [{"id": "c1", "type": "function", "function": {
                                "name": "f", "arguments": "{}"}}]}]
    assert "<think>I need a tool</think>" in _prompt(server, messages=messages)


def test_chat_completion_counts_the_rendered_prompt(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    off = httpx.post(server.url + "/v1/chat/completions",
                     json={**body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert plain.status_code == off.status_code == 200, (plain.text, off.text)
    think_tokens = len(httpx.post(server.url + "/tokenize", json={
        "prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False}, timeout=60).json()["tokens"])
    assert off.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + think_tokens


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
    {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
    {"messages": MESSAGES, "chat_template_kwargs": "enable_thinking"},
    {"prompt": "Hi", "chat_template_kwargs": {"enable_thinking": False}},
    # a function the template calls, replaced by a string: a TypeError in the template (500)
    {"messages": [{"role": "system", "content": "x"}],
     "chat_template_kwargs": {"raise_exception": "no"}},
    {"messages": MESSAGES, "chat_template_kwargs": {"strftime_now": 1}},
])
def test_misuse_is_a_400_naming_the_field(server: ServerProcess, body: dict) -> None:
    for path in ("/tokenize", "/v1/chat/completions"):
        if path != "/tokenize" and "prompt" in body:
            continue
        resp = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "chat_template_kwargs", resp.text


def test_a_conversation_the_template_refuses_is_a_400(server: ServerProcess) -> None:
    """`raise_exception` in a template is how it says the conversation is not one it can
    render: the client's mistake, a 400 with the template's words (it was a 500)."""
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    for path in ("/tokenize", "/v1/chat/completions"):
        resp = httpx.post(server.url + path, json={"model": "tiny", "messages": messages},
                          timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "messages", resp.text
        assert "System role not supported" in error["message"], resp.text


def test_a_template_variable_of_the_wrong_type_is_a_400(server: ServerProcess) -> None:
    """The template fails on the caller's value (`messages[-"two":]`: a TypeError, once a
    500): a 400 saying the template failed on this input."""
    two = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, *MESSAGES]
    assert _prompt(server, messages=two, chat_template_kwargs={"keep_last": 1}).count(
        "<|im_start|>") == 2  # the last message and the generation prompt
    for path in ("/tokenize", "/v1/chat/completions"):
        resp = httpx.post(server.url + path, json={
            "model": "tiny", "messages": two, "chat_template_kwargs": {"keep_last": "two"}},
            timeout=60)
        assert resp.status_code == 400, resp.text
        assert "the chat template failed on this input: TypeError" in resp.json()["error"][
            "message"], resp.text
