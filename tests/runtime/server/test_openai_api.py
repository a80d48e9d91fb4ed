"""The OpenAI API surface, through the official `openai` client against a real server."""

from __future__ import annotations

import json
import math
import uuid

import httpx
import pytest
from argosy_runtime import SamplingParams
from openai import BadRequestError, OpenAI
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

PROMPT = "The three primary colors are"


def greedy(client: OpenAI, prompt: str | list[int], max_tokens: int = 16, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw)


def test_models_lists_the_served_model(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_equals_offline_greedy(client: OpenAI, offline_llm) -> None:
    expected = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0]
    got = greedy(client, PROMPT)
    assert got.choices[0].text == expected.outputs[0].text
    assert got.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_completion_stream_equals_non_stream(client: OpenAI) -> None:
    whole = greedy(client, PROMPT, max_tokens=24)
    chunks = list(greedy(client, PROMPT, max_tokens=24, stream=True,
                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert len([c for c in chunks if c.choices]) > 3  # really incremental
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_count_every_chunk(client: OpenAI, endpoint: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "completions":
        chunks = list(greedy(client, PROMPT, max_tokens=12, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12,
            temperature=0, stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12  # cumulative, up to the final usage
    assert len(set(counts)) > 3  # counted as they came, not only at the end
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_count_each_choice(client: OpenAI, http: httpx.Client,
                                                  endpoint: str) -> None:
    """With n=2 (and two prompts of different lengths on completions), a chunk's usage is its
    choice's counts so far, as vLLM's; the last chunk's is the whole response's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(max_tokens=6, n=2, temperature=1.0, seed=3, stream=True, stream_options=options,
              extra_body={"ignore_eos": True})
    if endpoint == "completions":
        prompts = [PROMPT, "Hi"]
        chunks = list(client.completions.create(model=MODEL, prompt=prompts, **kw))
        lengths = [len(http.post("/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"])
                   for p in prompts]
        prompt_of = {c: lengths[c // 2] for c in range(4)}
    else:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], **kw))
        prompt_of = {c: chunks[-1].usage.prompt_tokens for c in range(2)}
    counts: dict[int, list[int]] = {c: [] for c in prompt_of}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert chunk.usage.prompt_tokens == prompt_of[choice.index]
        counts[choice.index].append(chunk.usage.completion_tokens)
    for per_choice in counts.values():
        assert per_choice == sorted(per_choice) and per_choice[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6 * len(counts)
    assert chunks[-1].usage.prompt_tokens == (sum(lengths) if endpoint == "completions"
                                              else prompt_of[0])


def test_chat_stream_equals_non_stream(client: OpenAI, offline_llm) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # the same prompt through the model's chat template offline
    expected = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    assert whole.choices[0].message.content == expected.outputs[0].text


def test_max_completion_tokens_and_ignore_eos(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=7,
        extra_body={"ignore_eos": True, "min_tokens": 7})
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"


def test_n_with_seed_is_reproducible(client: OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0,
              seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # each choice cut by max_tokens has 8 tokens, one that stopped earlier 1 to 7
    cut = sum(c.finish_reason == "length" for c in a.choices)
    assert 8 * cut + (3 - cut) <= a.usage.completion_tokens <= 8 * cut + 7 * (3 - cut)
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_stop_string_truncates_in_both_modes(client: OpenAI) -> None:
    base = greedy(client, PROMPT, max_tokens=24).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    cut = base[: base.index(stop)]
    got = greedy(client, PROMPT, max_tokens=24, stop=[stop])
    assert got.choices[0].text == cut
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in
                       greedy(client, PROMPT, max_tokens=24, stop=[stop], stream=True))
    assert streamed == cut


def test_completion_logprobs(client: OpenAI) -> None:
    r = greedy(client, PROMPT, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_stream(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, stream=True))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-4)


def test_token_id_prompt_and_batch(client: OpenAI, offline_llm) -> None:
    ids = offline_llm.get_tokenizer().encode(PROMPT)
    by_text = greedy(client, PROMPT).choices[0].text
    assert greedy(client, ids).choices[0].text == by_text
    other = "Water boils at"
    batch = greedy(client, [PROMPT, other])
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text
    assert batch.choices[1].text == greedy(client, other).choices[0].text
    echoed = greedy(client, PROMPT, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text


def test_penalties_and_vllm_extras_accepted(client: OpenAI) -> None:
    prompt = "one one one one one one one one"
    plain = greedy(client, prompt, max_tokens=12).choices[0].text
    penalized = greedy(client, prompt, max_tokens=12, frequency_penalty=2.0,
                       presence_penalty=2.0).choices[0].text
    assert penalized != plain
    r = greedy(client, prompt, max_tokens=4,
               extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3,
                           "stop_token_ids": [], "ignore_eos": True, "min_tokens": 4})
    assert r.usage.completion_tokens == 4


def test_priority_is_accepted_on_completions_and_chat(client: OpenAI) -> None:
    # vLLM's extra: it orders scheduling (test_priority_api.py) and never changes the output.
    plain = greedy(client, PROMPT, max_tokens=6).choices[0].text
    for priority in (-(2**31), -3, 7, 2**31 - 1):
        r = greedy(client, PROMPT, max_tokens=6, extra_body={"priority": priority})
        assert r.choices[0].text == plain
    messages = [{"role": "user", "content": "Name a fruit."}]
    chats = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, **kw)
             for kw in ({}, {"extra_body": {"priority": 5}})]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content


def test_request_id_echoed_and_logged(server: ServerProcess, http: httpx.Client) -> None:
    rid = "test-" + uuid.uuid4().hex
    r = http.post("/v1/completions", headers={"X-Request-Id": rid},
                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    generated = http.get("/v1/models").headers["x-request-id"]
    assert generated and generated != rid
    lines = [json.loads(line.split(" argosy.access ", 1)[1])
             for line in server.log_text().splitlines() if " argosy.access " in line]
    mine = [entry for entry in lines if entry["request_id"] == rid]
    assert len(mine) == 1
    assert mine[0]["status"] == 200 and mine[0]["completion_tokens"] == 2
    assert mine[0]["path"] == "/v1/completions" and mine[0]["duration_ms"] > 0


def test_runtime_lora_updates_are_off_by_default(http: httpx.Client) -> None:
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        r = http.post(path, json=body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "runtime_lora_updates_disabled"
        assert "--allow-runtime-lora-updates" in r.json()["error"]["message"]


DESIGN_METRICS = [
    "argosy:kv_cache_usage_perc", "argosy:num_requests_running", "argosy:num_requests_waiting",
    "argosy:prompt_tokens_total", "argosy:generation_tokens_total",
    "argosy:prefix_cache_queries_total", "argosy:prefix_cache_hits_total",
    "argosy:num_preemptions_total", "argosy:spec_decode_num_draft_tokens_total",
    "argosy:spec_decode_num_accepted_tokens_total", "argosy:cache_config_info",
]
HISTOGRAMS = ["argosy:time_to_first_token_seconds", "argosy:inter_token_latency_seconds",
              "argosy:e2e_request_latency_seconds", "argosy:request_queue_time_seconds"]


def test_metrics_expose_design_names(server: ServerProcess, client: OpenAI) -> None:
    before = server.metrics()
    r = greedy(client, "Metrics test prompt", max_tokens=5,
               extra_body={"ignore_eos": True})
    after = server.metrics()
    for name in DESIGN_METRICS:
        assert name in after, name
    for name in HISTOGRAMS:
        assert after[name + "_count"] >= before.get(name + "_count", 0) + 1, name
        assert name + "_bucket" in after
    assert after["argosy:generation_tokens_total"] - before["argosy:generation_tokens_total"] \
        >= r.usage.completion_tokens
    assert after["argosy:inter_token_latency_seconds_count"] - \
        before["argosy:inter_token_latency_seconds_count"] >= 4
    assert 0.0 <= after["argosy:kv_cache_usage_perc"] <= 1.0


def test_requests_without_tokens_count_their_queue_time(server: ServerProcess,
                                                        client: OpenAI) -> None:
    """An embedding and an echo-scoring request (max_tokens 0) produce no token: no time to
    first token, but their queue time is observed like any request's (it was not)."""
    before = server.metrics()
    client.embeddings.create(model=MODEL, input="queued like any other request")
    client.completions.create(model=MODEL, prompt="scored, not continued", max_tokens=0,
                              echo=True, logprobs=0)
    after = server.metrics()
    count = "argosy:request_queue_time_seconds_count"
    assert after[count] - before.get(count, 0) == 2
    ttft = "argosy:time_to_first_token_seconds_count"
    assert after.get(ttft, 0) == before.get(ttft, 0)


def test_health_ready_open(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openapi_documents_routes(http: httpx.Client, path: str) -> None:
    spec = http.get("/openapi.json").json()
    assert "post" in spec["paths"][path]


def test_tokenize_counts_what_generation_sees(client: OpenAI, http: httpx.Client,
                                              offline_llm) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == offline_llm.engine.tokenizer.encode(PROMPT)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] > r["count"]
    assert r["count"] == greedy(client, PROMPT, max_tokens=1).usage.prompt_tokens
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"].endswith(PROMPT)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, 400, "tokens"),
])
def test_tokenize_errors(http: httpx.Client, path: str, body: dict, status: int,
                         param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client: OpenAI,
                                                                  server: ServerProcess) -> None:
    # A prompt nobody sent before: at most the chat template's opening (shared with every
    # chat) is cached. Sent again: every full block before its last token comes from the
    # prefix cache (as the server's own counter agrees).
    topic = uuid.uuid4().hex
    messages = [{"role": "user", "content": f"Notes on {topic}: " + "the tide rises; " * 30}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens <= 32
    hits = server.metrics()["argosy:prefix_cache_hits_total"]
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert server.metrics()["argosy:prefix_cache_hits_total"] - hits == cached
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks
    assert again.usage.prompt_tokens - cached <= 16  # all but the last partial block
    # The completions endpoint sums over its prompts; streamed usage says the same.
    prompt = f"Story {topic}: " + "once upon a time " * 30
    assert greedy(client, prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0
    twice = greedy(client, [prompt, prompt], max_tokens=1)
    assert twice.usage.prompt_tokens_details.cached_tokens >= 2 * 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    response = client.responses.create(model=MODEL, input=messages, max_output_tokens=1)
    assert response.usage.input_tokens_details.cached_tokens == cached


def test_each_owner_has_a_prefix_cache_of_its_own(client: OpenAI) -> None:
    """The tenant a gateway names (`X-Argosy-Owner`) salts its requests' prefix cache, as
    OpenAI keeps prompt caches per organization: another tenant's `cached_tokens` would
    otherwise tell whether this one sent a prompt. Its own `cache_salt` divides it further."""
    topic = uuid.uuid4().hex
    messages = [{"role": "user", "content": f"Secret {topic}: " + "the tide rises; " * 30}]

    def cached(owner: str, salt: str | None = None) -> int:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1,
            extra_headers={"X-Argosy-Owner": owner},
            extra_body={"cache_salt": salt} if salt else None,
        ).usage.prompt_tokens_details.cached_tokens

    assert cached("team-a") == 0
    assert cached("team-a") > 32
    assert cached("team-b") == 0
    assert cached("team-b", "team-a") == 0  # a salt cannot reach into another's cache
    assert cached("team-a", "sub") == 0
    assert cached("team-a", "sub") > 32
    # Nor does a request naming no owner (a direct call with the replica's key) hit them,
    # even with a salt that spells an owner's and its salt (it was team-a's "sub").
    for salt in (None, "team-a\0sub"):
        assert client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1,
            extra_body={"cache_salt": salt} if salt else None,
        ).usage.prompt_tokens_details.cached_tokens <= 32


def test_cache_salt_keeps_prefix_cache_hits_within_one_salt(client: OpenAI) -> None:
    """vLLM's `cache_salt` (extra_body): a conversation cached under one salt (or none) is
    no hit under another, and is under its own; on chat, completions (beam search too) and
    responses alike."""
    topic = uuid.uuid4().hex
    messages = [{"role": "user", "content": f"Notes on {topic}: " + "the tide rises; " * 30}]

    def chat_cached(salt: str | None) -> int:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1,
            extra_body={"cache_salt": salt} if salt else None,
        ).usage.prompt_tokens_details.cached_tokens

    chat_cached(None)
    assert chat_cached(None) > 32
    assert chat_cached("tenant-a") <= 32  # the template's opening, cached by a-salted chats
    assert chat_cached("tenant-a") > 32
    assert chat_cached("tenant-b") <= 32
    prompt = f"Story {topic}: " + "once upon a time " * 30
    salted = {"cache_salt": "tenant-a"}
    assert greedy(client, prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=salted
                                     ).usage.prompt_tokens_details.cached_tokens == 0
    response = client.responses.create(model=MODEL, input=messages, max_output_tokens=1,
                                       extra_body={"cache_salt": "tenant-c"})
    assert response.usage.input_tokens_details.cached_tokens <= 32
    beams = {**salted, "use_beam_search": True, "n": 2}
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=beams)
    with pytest.raises(BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": ""})
