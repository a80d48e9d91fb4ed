"""Structured outputs and logit_bias through the official `openai` client: OpenAI's
`response_format` (json_object, json_schema, the client's pydantic `parse`), vLLM's
`structured_outputs` extra, streaming, and the same tokens as the offline engine."""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pydantic
import pytest
from argosy_runtime import SamplingParams, StructuredOutputsParams
from openai import OpenAI
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=100)


MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_parse_with_a_pydantic_model_equals_the_offline_engine(client: OpenAI,
                                                               offline_llm) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City,
                                      temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    # The client sent City's JSON schema; the offline engine with that schema agrees exactly.
    schema = City.model_json_schema() | {"additionalProperties": False}
    expected = offline_llm.chat(MESSAGES, SamplingParams(
        temperature=0, max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=schema)))[0].outputs[0]
    assert choice.message.content == expected.text
    assert r.usage.completion_tokens == len(expected.token_ids)


def test_json_schema_stream_equals_non_stream(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
        "minItems": 2, "maxItems": 3}}, "required": ["colors"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": schema}}
    messages = [{"role": "user", "content": "Name primary colors as JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=60, response_format=fmt)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=60, response_format=fmt,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len(chunks) > 4
    jsonschema.validate(json.loads(text), schema)


def test_json_object_with_n_and_seed(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, n=3, seed=11, temperature=0.8, max_tokens=60)
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_structured_outputs_extra_on_completions(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:",
                                  max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.7, seed=3, stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit()


def test_logit_bias_forces_and_bans_tokens(client: OpenAI, offline_llm) -> None:
    tok = offline_llm.engine.tokenizer
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=4,
                                  temperature=0.9, logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 4
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0)
    first = tok.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})
    assert tok.encode(banned.choices[0].text, add_special_tokens=False)[0] != first


# Passes the compile-time check, then fails once the output reaches the second item's huge
# `pattern` (llguidance: "lexer error: too many expressions constructed").
FAILS_MID_GENERATION = {"type": "array", "minItems": 2, "prefixItems": [
    {"type": "integer"}, {"type": "string", "pattern": "^a{1000000}$"}]}
BAD_PROMPT = "A list of a number and a string of a's in JSON:"


def _sse(http: httpx.Client, path: str, body: dict,
         headers: dict[str, str] | None = None) -> list[dict | str]:
    """A streamed response's events, parsed ("[DONE]" as is)."""
    events: list[dict | str] = []
    with http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("constraint, param, words", [
    # JSON text nested past Python's recursion limit was a RecursionError: a 500
    ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs.json",
     "structured_outputs.json is nested too deeply"),
    # a number llguidance cannot take was "Value is not JSON serializable: ...", param null
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 10**30}}},
     "structured_outputs.json", "structured_outputs.json: the integer 1000"),
    # this one killed the server process (SIGSEGV inside llguidance)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "const": -(2**63)}}}}, "response_format",
     "response_format: json_schema.schema: the integer -9223372036854775808 is out of"),
    ({"structured_outputs": {"grammar": 'start: %json{"enum": [-9223372036854775808]}'}},
     "structured_outputs.grammar", "structured_outputs.grammar: the integer"),
    # compiled for over 20 s in 1.5 GB (2**31: longer than anyone waited), a thread pinned
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "multipleOf": 2**24}}}}, "response_format",
     "response_format: json_schema.schema: multipleOf 16777216 has too many digits"),
])
def test_unusable_schemas_are_400s_naming_the_field(http: httpx.Client, constraint: dict,
                                                    param: str, words: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 5, **body, **constraint})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(words), err
    assert http.get("/health").status_code == 200  # still serving


def test_vllm_structured_outputs_options_are_honoured_or_refused_by_name(
        http: httpx.Client) -> None:
    """The options vLLM clients send beside the constraint were 400 "unknown field". Unlisted
    properties are refused (the model writes "id", "name", ... without the option), the
    whitespace pattern holds (none allowed: compact JSON), `disable_fallback` is accepted,
    and `structural_tag` is a 400 that says it is not supported."""
    schema = {"type": "object",
              "properties": {"population": {"type": "integer", "minimum": 0,
                                            "maximum": 100_000_000}}}
    body = {"model": MODEL, "prompt": "Describe Paris as JSON:", "max_tokens": 40,
            "temperature": 0}
    so = {"json": schema, "disable_additional_properties": True, "whitespace_pattern": "",
          "disable_fallback": True}
    r = http.post("/v1/completions", json={**body, "structured_outputs": so})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    value = json.loads(choice["text"])
    assert choice["finish_reason"] == "stop" and set(value) <= {"population"}, choice
    assert choice["text"] == json.dumps(value, separators=(",", ":")), choice
    for extra, param, words in (
            ({"whitespace_pattern": "[a-"}, "structured_outputs.whitespace_pattern", "unclosed"),
            ({"structural_tag": '{"type": "structural_tag"}'},
             "structured_outputs.structural_tag", "is not supported")):
        r = http.post("/v1/completions", json={**body, "structured_outputs": {**so, **extra}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err


def test_a_grammar_past_the_matcher_limits_is_a_400_before_any_token(http: httpx.Client) -> None:
    """The fuzzed `a{1000000}` compiles, then fails on its first token: it used to return
    one token with finish_reason "stop". The compile-time probe makes it a 400 naming the
    field the client wrote."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5,
                                           "structured_outputs": {"regex": "a{1000000}"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "structured_outputs" and "too complex" in err["message"], err
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "pattern": "^a{1000000}$"}}}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                "max_tokens": 5, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format", err
    assert err["message"].startswith("response_format: the grammar is too complex"), err


def test_a_grammar_failing_mid_generation_is_an_error_not_a_stop(http: httpx.Client) -> None:
    """Whole: a 400 naming the field (never a 200 with "stop", never a 500). Streamed: the
    chunks so far, an error event with the same body, then [DONE]; no chunk has a
    finish_reason. A valid
    constrained request batched with it completes exactly as alone, and nothing stays held."""
    body = {"model": MODEL, "prompt": BAD_PROMPT, "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"json": FAILS_MID_GENERATION}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "structured_outputs" and err["type"] == "invalid_request_error"
    assert err["message"].startswith("structured_outputs: the grammar failed after "), err
    assert "too many expressions" in err["message"]

    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema":
                                                  FAILS_MID_GENERATION}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": BAD_PROMPT}],
            "max_tokens": 60, "temperature": 0, "response_format": fmt}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format", err
    assert err["message"].startswith("response_format: the grammar failed after "), err

    good = {"model": MODEL, "prompt": "Describe a person as JSON:", "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"json": City.model_json_schema()}}
    alone = http.post("/v1/completions", json=good).json()["choices"][0]
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_sse, http, "/v1/completions", body)
        batched = pool.submit(http.post, "/v1/completions", json=good)
        events, together = streamed.result(), batched.result().json()["choices"][0]
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["param"] == "structured_outputs", error
    assert error["message"].startswith("structured_outputs: the grammar failed after "), error
    chunks = events[:-2]  # the text before the failure (none if it came in the same output)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert "[".startswith("".join(c["choices"][0]["text"] for c in chunks)[:1])
    assert (together["text"], together["finish_reason"]) == (alone["text"],
                                                             alone["finish_reason"])
    if together["finish_reason"] == "stop":
        City.model_validate_json(together["text"])
    for _ in range(50):  # the failed request's blocks went back to the pool
        metrics = http.get("/metrics").text
        if ("argosy:num_requests_running{" in metrics and all(
                float(line.split()[-1]) == 0 for line in metrics.splitlines()
                if line.startswith(("argosy:num_requests_running",
                                    "argosy:kv_cache_usage_perc")))):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(metrics)


def _access_log(server: ServerProcess, request_id: str) -> dict:
    """The request log line of `request_id` (written once the response has ended)."""
    for _ in range(50):
        mine = [json.loads(line.split(" argosy.access ", 1)[1])
                for line in server.log_text().splitlines() if " argosy.access " in line]
        mine = [entry for entry in mine if entry["request_id"] == request_id]
        if mine:
            assert len(mine) == 1, mine
            return mine[0]
        time.sleep(0.1)
    raise AssertionError(f"no request log line for {request_id}")


def _failed_after(error: dict) -> int:
    """How many tokens the failed request generated, as its error message says."""
    match = re.search(r"the grammar failed after (\d+) generated token", error["message"])
    assert match, error
    return int(match.group(1))


def test_a_stream_failing_mid_generation_sends_its_text_before_the_error(
        server: ServerProcess, http: httpx.Client) -> None:
    """The output that carries the failure also carries its last token(s) (all those not yet
    sent, when outputs merged because the client lagged): their text goes out first, then
    the error event, then [DONE]. Every generated token is sent (the failed grammar's
    compiled state is cached, so how many that is varies: the error says). The request log
    says finish_reason "error", streamed or not."""
    body = {"model": MODEL, "prompt": BAD_PROMPT, "max_tokens": 40, "temperature": 0,
            "logprobs": 0, "structured_outputs": {"json": FAILS_MID_GENERATION}}
    rid = "failing-stream-" + uuid.uuid4().hex
    events = _sse(http, "/v1/completions", body, headers={"X-Request-Id": rid})
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    chunks = events[:-2]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks), chunks
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == _failed_after(events[-2]["error"]) >= 1, events
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(tokens)
    assert "".join(tokens).startswith("[")
    entry = _access_log(server, rid)
    assert (entry["status"], entry["finish_reason"]) == (200, "error"), entry

    rid = "failing-whole-" + uuid.uuid4().hex
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 400, r.text
    entry = _access_log(server, rid)
    assert (entry["status"], entry["finish_reason"]) == (400, "error"), entry

    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema":
                                                  FAILS_MID_GENERATION}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": BAD_PROMPT}],
            "max_tokens": 40, "temperature": 0, "logprobs": True, "response_format": fmt}
    rid = "failing-chat-stream-" + uuid.uuid4().hex
    events = _sse(http, "/v1/chat/completions", chat, headers={"X-Request-Id": rid})
    assert events[-1] == "[DONE]" and events[-2]["error"]["param"] == "response_format"
    chunks = events[:-2]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks), chunks
    tokens = [t["token"] for c in chunks if c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == _failed_after(events[-2]["error"]) >= 1, events
    assert "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks) == "".join(tokens)
    assert _access_log(server, rid)["finish_reason"] == "error"


def test_logprob_bytes_of_a_character_split_across_tokens_join_into_it(client: OpenAI) -> None:
    """An emoji is three byte-level tokens, each decoded alone as U+FFFD: their `bytes` are
    the token's own (OpenAI's), which join into the character, in the stream too."""
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True,
              top_logprobs=2, extra_body={"structured_outputs": {"regex": "😀é!"}})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "😀é!"
    assert any(t.token == "\ufffd" for t in content)  # a real split
    assert bytes(b for t in content for b in t.bytes).decode() == "😀é!"
    for t in content:
        for alt in t.top_logprobs:
            assert alt.bytes == list(alt.token.encode()) or alt.token == "\ufffd"
    streamed = [t for chunk in client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert bytes(b for t in streamed for b in t.bytes).decode() == "😀é!"
