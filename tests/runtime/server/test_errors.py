"""Bad input gets a 4xx with an OpenAI-style error body, never a 500; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import MODEL

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

C, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# (path, json body or raw bytes, expected status, expected param or None)
CASES = [
    (C, b'{"model": "smollm2-135m", "prompt": ', 400, None),  # malformed JSON
    (C, b"", 400, None),  # empty body
    (C, b"[1, 2, 3]", 400, None),  # not an object
    (C, b'{"prompt": "x", "max_tokens": NaN}', 400, "max_tokens"),
    (C, {"model": MODEL}, 400, "prompt"),  # missing prompt
    (C, {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (C, {"model": MODEL, "prompt": 42}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    (C, {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    (C, {"model": MODEL, "prompt": "word " * 3000}, 400, "prompt"),  # > max_model_len
    # the prompt fits alone: the error names the field that asks for too much
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    # longer than 2048 tokens of the longest (81 characters) hold: refused untokenized
    (C, {"model": MODEL, "prompt": "x" * (2048 * 81 + 1)}, 400, "prompt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}]}, 400,
     "messages"),
    # booleans and floats are not token ids or counts (pydantic's lax int took true as 1)
    (C, {"model": MODEL, "prompt": [True, False]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": [1.0]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": [[1, True]]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (CHAT, {"model": MODEL, "messages": MSG, "stop_token_ids": [49152]}, 400,
     "stop_token_ids"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 16.0}, 400, "max_tokens"),
    (C, {"model": MODEL, "prompt": "x", "n": True}, 400, "n"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": True}, 400,
     "max_completion_tokens"),
    # stream_options without stream (OpenAI and vLLM refuse it too)
    (C, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": False,
            "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (RESP, {"model": MODEL, "input": "hi", "stream_options": {"include_obfuscation": False}},
     400, "stream_options"),
    (RESP, {"model": MODEL, "input": "hi", "stream": False,
            "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    # booleans and strings are not sampling numbers (lax float took true as 1.0); ints are
    (C, {"model": MODEL, "prompt": "x", "temperature": True}, 400, "temperature"),
    (C, {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    (C, {"model": MODEL, "prompt": "x", "top_p": True}, 400, "top_p"),
    (C, {"model": MODEL, "prompt": "x", "min_p": False}, 400, "min_p"),
    (C, {"model": MODEL, "prompt": "x", "presence_penalty": True}, 400, "presence_penalty"),
    (C, {"model": MODEL, "prompt": "x", "frequency_penalty": True}, 400, "frequency_penalty"),
    (C, {"model": MODEL, "prompt": "x", "repetition_penalty": True}, 400,
     "repetition_penalty"),
    (C, {"model": MODEL, "prompt": "x", "length_penalty": True}, 400, "length_penalty"),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": True}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": True}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": False}, 400,
     "presence_penalty"),
    (CHAT, {"model": MODEL, "messages": MSG, "repetition_penalty": True}, 400,
     "repetition_penalty"),
    (CHAT, {"model": MODEL, "messages": MSG, "length_penalty": True}, 400, "length_penalty"),
    (RESP, {"model": MODEL, "input": "hi", "temperature": True}, 400, "temperature"),
    (RESP, {"model": MODEL, "input": "hi", "top_p": True}, 400, "top_p"),
    (RESP, {"model": MODEL, "input": "hi", "min_p": True}, 400, "min_p"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    (C, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    (C, {"model": MODEL, "prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    (C, {"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    (C, {"model": MODEL, "prompt": "x", "stop": [""]}, 400, None),
    (C, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": [-1]}, 400, "prompt"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias[1]"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    # int() would read these as 10, 5 and 3
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"1_0": 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "("}}, 400,
     "structured_outputs"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {}}, 400, "structured_outputs"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs.choice"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {"grammar": "start: x\nx: x"}},
     400, "structured_outputs"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {"json": "{"}}, 400,
     "structured_outputs.json"),
    (C, {"model": MODEL, "prompt": "x", "structured_outputs": {"jsn": {}}}, 400,
     "structured_outputs"),
    (C, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    (C, {"model": MODEL, "prompt": "x", "priority": "high"}, 400, "priority"),
    (C, {"model": MODEL, "prompt": "x", "priority": 1.5}, 400, "priority"),
    (C, {"model": MODEL, "prompt": "x", "priority": "1"}, 400, "priority"),  # no coercion
    (C, {"model": MODEL, "prompt": "x", "priority": 2**31}, 400, "priority"),
    (CHAT, {"model": MODEL, "messages": MSG, "priority": True}, 400, "priority"),
    (CHAT, {"model": MODEL, "messages": MSG, "priority": None}, 400, "priority"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hello"}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    # a schema with another type was ignored: the output went unconstrained
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400,
     "response_format"),
    (C, {"model": MODEL, "prompt": "hi", "response_format": {
        "type": "text", "json_schema": {"name": "x"}}}, 400, "response_format"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400,
     "response_format"),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}],
            "tool_choice": "auto"}, 400, "tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, 400,
     "tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "has space"}}]}, 400, "tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}]}, 400,
     "tools"),
    (CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": 7}, 400, "presence_penalty"),
    (CHAT, {"model": "gpt-4", "messages": MSG}, 404, "model"),
    # tools go through the chat template with messages; with a prompt they were ignored
    ("/tokenize", {"model": MODEL, "prompt": "x", "tools": TOOLS}, 400, "tools"),
]


def _check_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_bad_request_is_4xx_with_openai_body(http: httpx.Client, path: str, body, status: int,
                                              param: str | None) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = _check_error_body(r, status)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("path", [C, CHAT])
def test_priority_must_be_an_integer(http: httpx.Client, path: str) -> None:
    # A known field with a wrong type (not "unknown field"): vLLM's extra is accepted.
    body = {"model": MODEL, "prompt": "x"} if path == C else {"model": MODEL, "messages": MSG}
    err = _check_error_body(http.post(path, json={**body, "priority": 0.5}), 400)
    assert err["param"] == "priority" and "integer" in err["message"], err
    assert http.post(path, json={**body, "priority": -1, "max_tokens": 1}).status_code == 200


def test_context_length_code(http: httpx.Client) -> None:
    r = http.post(C, json={"model": MODEL, "prompt": "word " * 3000})
    assert _check_error_body(r, 400)["code"] == "context_length_exceeded"


def test_text_too_long_for_any_tokenization_is_refused_untokenized(http: httpx.Client) -> None:
    # 10 MB used to take ~25 s of tokenizer time on the event loop before this 400
    r = http.post(C, json={"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 1},
                  timeout=10)
    err = _check_error_body(r, 400)
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    # with truncation asked for, a long text is tokenized (and cut), not refused
    r = http.post(C, json={"model": MODEL, "prompt": "word " * 50_000, "max_tokens": 1,
                           "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text


def test_characters_the_tokenizer_drops_do_not_count_toward_the_length(http: httpx.Client) -> None:
    # SmolLM2 has no token for the byte 0x04: 400k of them are 0 tokens, not "too long"
    r = http.post(C, json={"model": MODEL, "prompt": "\x04" * 400_000 + "Hi", "max_tokens": 1},
                  timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text


def test_body_over_the_size_limit_is_a_413(http: httpx.Client) -> None:
    limit = 16 << 20  # --max-request-body-size's default
    body = b'{"prompt": "' + b"a" * limit + b'"}'
    headers = {"content-type": "application/json"}
    # refused on its Content-Length, unread; and a chunked body once it passes the limit
    for content in (body, (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))):
        err = _check_error_body(http.post(C, content=content, headers=headers), 413)
        assert err["code"] == "request_too_large" and str(limit) in err["message"], err
    chunked = (part for part in (b'{"prompt": "x", ', b'"max_tokens": 1}'))
    assert http.post(C, content=chunked, headers=headers).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _check_error_body(http.get("/v1/nope"), 404)
    _check_error_body(http.get(C), 405)


def test_server_keeps_serving_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        http.post(C, content=b"{{{{", headers={"content-type": "application/json"})
    r = http.post(C, json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# A lone UTF-16 surrogate, as JSON spells it (an escape): not valid Unicode, so no tokenizer
# can take it (it was a 500 that also cut the keep-alive connection).
LONE = "\\ud83d"
SURROGATE_CASES = [
    (C, f'{{"prompt": "Hi {LONE}", "max_tokens": 1}}', "prompt"),
    (C, f'{{"prompt": "Hi", "max_tokens": 1, "bad_words": ["{LONE}"]}}', "bad_words[0]"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "{LONE}"}}], "max_tokens": 1}}',
     "messages[0].content"),
    ("/v1/embeddings", '{"input": ["ok", "\\udc00"]}', "input[1]"),
    ("/tokenize", f'{{"prompt": "{LONE}"}}', "prompt"),
    ("/v1/rerank", f'{{"query": "{LONE}", "documents": ["a"]}}', "query"),
    ("/v1/responses", f'{{"input": "{LONE}", "max_output_tokens": 1}}', "input"),
]


@pytest.mark.parametrize(("path", "raw", "where"), SURROGATE_CASES)
def test_lone_surrogate_is_a_400(http: httpx.Client, path: str, raw: str, where: str) -> None:
    r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    err = _check_error_body(r, 400)
    assert "surrogate" in err["message"] and where in err["message"], err
    # the same connection still serves
    assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_surrogate_pairs_and_escaped_backslashes_are_fine(http: httpx.Client) -> None:
    raw = r'{"prompt": "\ud83d\ude00 and \\ud83d"}'  # an emoji, then a backslash + "ud83d"
    r = http.post("/tokenize", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "\U0001f600 and \\ud83d"


# Bodies json.loads refuses with an error other than JSONDecodeError: FastAPI answered each
# with a bare "There was an error parsing the body" that named no cause.
UNPARSABLE_CASES = [
    # past Python's int-string conversion limit (4300 digits)
    (C, b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", ["number too large", "4300"]),
    (RESP, b'{"input": "hi", "max_output_tokens": -' + b"9" * 4301 + b"}",
     ["number too large", "4300"]),
    ("/tokenize", b'{"prompt": "caf\xe9"}', ["not valid utf-8"]),  # Latin-1, not UTF-8
    # a UTF-16 surrogate encoded as UTF-8 bytes (not an escape): json.loads lets it through
    (C, b'{"prompt": "Hi \xed\xa0\xbd", "max_tokens": 1}', ["not valid utf-8", "byte 15"]),
    (C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ["nested too deeply"]),
]


@pytest.mark.parametrize(("path", "raw", "words"), UNPARSABLE_CASES)
def test_unparsable_body_is_a_400_naming_the_cause(http: httpx.Client, path: str, raw: bytes,
                                                   words: list[str]) -> None:
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    err = _check_error_body(r, 400)
    assert err["type"] == "invalid_request_error", err
    for word in words:
        assert word in err["message"], err
    # the same connection still serves
    assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_integer_at_the_digit_limit_is_parsed(http: httpx.Client) -> None:
    # 4300 digits is still a number: refused by the field check, not by the parser
    raw = b'{"prompt": "x", "max_tokens": ' + b"1" * 4300 + b"}"
    r = http.post(C, content=raw, headers={"content-type": "application/json"})
    err = _check_error_body(r, 400)
    assert err["param"] == "max_tokens" and "number too large" not in err["message"], err


@pytest.mark.parametrize("path", [C, CHAT, RESP])
def test_int_sampling_values_are_accepted(http: httpx.Client, path: str) -> None:
    """Float fields are strict (no booleans, no strings) yet take an int, as JSON writes 1."""
    body = {"model": MODEL, "temperature": 0, "top_p": 1, "min_p": 0,
            "repetition_penalty": 1}
    if path == C:
        body |= {"prompt": "x", "max_tokens": 1, "presence_penalty": 0,
                 "frequency_penalty": 0, "length_penalty": 1}
    elif path == CHAT:
        body |= {"messages": MSG, "max_tokens": 1, "presence_penalty": 0,
                 "frequency_penalty": 0, "length_penalty": 1}
    else:
        body |= {"input": "hi", "max_output_tokens": 1, "store": False}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("message", "param"), [
    ("top_p must be in (0, 1], got 2", "top_p"),
    ("structured_outputs.regex: invalid regex", "structured_outputs.regex"),
    ("stop_token_ids[0]: must be an integer", "stop_token_ids[0]"),
    ("LoRA adapter 'x': cannot read adapter_model.safetensors", None),
    ("The prompt is empty", None),
])
def test_the_param_of_an_engine_error_is_a_field_name(message: str, param: str | None) -> None:
    from argosy_runtime.server.errors import param_from_value_error

    assert param_from_value_error(message) == param
