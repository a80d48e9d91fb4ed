"""`--reasoning-parser` on a real `argosy serve`: the thinking comes back in
`reasoning_content`, the answer in `content`, streamed or not.

The model is a scripted checkpoint (model_factory.make_scripted_model_dir): its greedy reply
to a chat is exactly " let me see</think>\\n\\nThe answer", as a DeepSeek-R1-style model whose
template opens <think> in the prompt would write it."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from serve_harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_scripted_model_dir  # noqa: E402

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

# " let", " me", " see", "</", "think", ">", "\n\n", "The", " answer" in SmolLM2's vocabulary,
# after the "\n" (198) that ends its chat template's generation prompt.
SCRIPT = [1303, 549, 963, 9617, 17400, 46, 1116, 504, 2988]
MESSAGES = [{"role": "user", "content": "What is it?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = make_scripted_model_dir(tmp_path_factory.mktemp("models"), 198, SCRIPT)
    proc = ServerProcess("--model", str(folder), "--served-model-name", "thinker",
                         "--reasoning-parser", "deepseek_r1")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_reply_is_what_the_script_says(server: ServerProcess) -> None:
    # Completions are never parsed: the raw reply, tags included.
    resp = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "thinker", "prompt": [198], "max_tokens": 20, "temperature": 0})
    assert resp.json()["choices"][0]["text"] == " let me see</think>\n\nThe answer"


def test_reasoning_and_answer_apart(client: OpenAI) -> None:
    reply = client.chat.completions.create(model="thinker", messages=MESSAGES, temperature=0)
    message = reply.choices[0].message
    assert message.content == "The answer"
    assert message.model_extra["reasoning_content"] == "let me see"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(SCRIPT) + 1  # the thinking counts too


def test_streamed_reasoning_then_answer(client: OpenAI) -> None:
    reasoning, content, order = "", "", []
    for chunk in client.chat.completions.create(model="thinker", messages=MESSAGES,
                                                temperature=0, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (r := (delta.model_extra or {}).get("reasoning_content")):
            reasoning += r
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
    assert (reasoning, content) == ("let me see", "The answer")
    # All the thinking first, then the answer. (How many chunks each takes depends on how
    # fast this client reads: the server coalesces what a slow reader missed.)
    assert order[0] == "reasoning" and "reasoning" not in order[order.index("content"):]


def test_a_constrained_reply_is_not_split(server: ServerProcess) -> None:
    # response_format constrains the reply from its first token: it cannot think, so the
    # parser leaves it alone (and deepseek_r1 would otherwise call it all reasoning).
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]}})
    message = resp.json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning_content" not in message


def test_history_may_carry_earlier_reasoning(client: OpenAI) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "The answer",
                           "reasoning_content": "let me see"},
               {"role": "user", "content": "Again?"}]
    reply = client.chat.completions.create(model="thinker", messages=history, temperature=0)
    assert reply.choices[0].message.content == "The answer"
