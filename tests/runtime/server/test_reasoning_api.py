"""`--reasoning-parser` on a real `argosy serve`: the thinking comes back in
`reasoning_content`, the answer in `content`, streamed or not, and usage counts its tokens
(`completion_tokens_details.reasoning_tokens`); on /v1/responses the thinking is a `reasoning`
output item before the message (`response.reasoning_text.*` events when streamed), and such
items sent back as input are accepted. Without a parser nothing of this appears.

The model is a scripted checkpoint (model_factory.make_scripted_model_dir): its greedy reply
to a chat is exactly " let me see</think>\\n\\nThe answer", as a DeepSeek-R1-style model whose
template opens <think> in the prompt would write it."""

from __future__ import annotations

import json
import sys
import time
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


# The generated tokens between the tags: " let", " me", " see" (vLLM counts so too).
REASONING_TOKENS = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model_dir(tmp_path_factory.mktemp("models"), 198, SCRIPT)


@pytest.fixture(scope="module")
def server(folder: Path):
    proc = ServerProcess("--model", str(folder), "--served-model-name", "thinker",
                         "--reasoning-parser", "deepseek_r1")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def plain_server(folder: Path):
    """The same model without a reasoning parser."""
    proc = ServerProcess("--model", str(folder), "--served-model-name", "thinker")
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
    assert reply.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_streamed_reasoning_then_answer(client: OpenAI) -> None:
    reasoning, content, order, usage = "", "", [], []
    for chunk in client.chat.completions.create(model="thinker", messages=MESSAGES,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if not chunk.choices:
            usage.append(chunk.usage)
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
    [final] = usage  # the final usage chunk
    assert final.completion_tokens == len(SCRIPT) + 1
    assert final.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_constrained_reply_is_not_split(server: ServerProcess) -> None:
    # response_format constrains the reply from its first token: it cannot think, so the
    # parser leaves it alone (and deepseek_r1 would otherwise call it all reasoning).
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]}})
    message = resp.json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning_content" not in message
    assert resp.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_history_may_carry_earlier_reasoning(client: OpenAI) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "The answer",
                           "reasoning_content": "let me see"},
               {"role": "user", "content": "Again?"}]
    reply = client.chat.completions.create(model="thinker", messages=history, temperature=0)
    assert reply.choices[0].message.content == "The answer"


def test_a_response_has_the_thinking_as_a_reasoning_item(client: OpenAI) -> None:
    r = client.responses.create(model="thinker", input="What is it?", temperature=0)
    assert r.status == "completed"
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "let me see")]
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert message.type == "message" and r.output_text == "The answer"
    assert r.usage.output_tokens == len(SCRIPT) + 1
    assert r.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    assert client.responses.retrieve(r.id).output[0].content[0].text == "let me see"


def test_a_streamed_response_sends_the_thinking_first(client: OpenAI) -> None:
    events = list(client.responses.create(model="thinker", input="What is it?",
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    thinking = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in thinking) == "let me see"
    assert kinds.index("response.reasoning_text.done") < first_text
    assert all(kinds.index(e.type) < first_text for e in thinking)
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "let me see" and done.output_index == 0
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "The answer"
    final = events[-1].response
    assert kinds[-1] == "response.completed" and [i.type for i in final.output] == [
        "reasoning", "message"]
    assert final.output[0].content[0].text == "let me see" and final.output_text == text
    assert final.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_background_response_has_its_reasoning_item(client: OpenAI) -> None:
    r = client.responses.create(model="thinker", input="What is it?", temperature=0,
                                background=True)
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        r = client.responses.retrieve(r.id)
    assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message"]
    assert r.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_reasoning_items_sent_back_are_accepted(client: OpenAI) -> None:
    first = client.responses.create(model="thinker", input="What is it?", temperature=0)
    # The whole history in input, the reasoning item included (OpenAI's manual way)...
    again = client.responses.create(
        model="thinker", temperature=0,
        input=[{"role": "user", "content": "What is it?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "Again?"}])
    assert again.status == "completed" and again.output_text == "The answer"
    listed = client.responses.input_items.list(again.id, order="asc").data
    assert [i.type for i in listed] == ["message", "reasoning", "message", "message"]
    assert listed[1].id == first.output[0].id and listed[1].content[0].text == "let me see"
    # ... or by previous_response_id (the stored conversation skips the thinking).
    follow = client.responses.create(model="thinker", input="Again?", temperature=0,
                                     previous_response_id=first.id)
    assert follow.status == "completed" and follow.output_text == "The answer"


def test_without_a_parser_there_is_no_reasoning(plain_server: ServerProcess) -> None:
    whole = " let me see</think>\n\nThe answer"
    chat = httpx.post(plain_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": MESSAGES, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == whole
    # as before: OpenAI's schema makes the details optional, and without a parser the
    # server cannot tell thinking from answer, so it claims no count (vLLM does the same)
    assert "completion_tokens_details" not in chat["usage"]
    with httpx.stream("POST", plain_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "thinker", "messages": MESSAGES, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and "completion_tokens_details" not in chunks[-1]["usage"]
    plain = OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    response = plain.responses.create(model="thinker", input="What is it?", temperature=0)
    assert [i.type for i in response.output] == ["message"] and response.output_text == whole
    assert response.usage.output_tokens_details.reasoning_tokens == 0
