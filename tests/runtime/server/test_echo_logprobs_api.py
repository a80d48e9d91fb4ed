"""`echo` with `logprobs` on /v1/completions, and `max_tokens: 0` with echo: OpenAI's legacy way
to score a text, which lm-evaluation-harness's `local-completions` model uses for every
loglikelihood task (token-id prompts, `echo`, `logprobs: 1`, the prompt's log-probabilities
read back). Checked on a real server against the offline engine's `prompt_logprobs`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from argosy_runtime import SamplingParams
from serve_harness import MODEL, ServerProcess

pytestmark = pytest.mark.slow  # starts `argosy serve` processes

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " Berlin"]
# The context-filling tests run on their own server with a shorter context: prefills of the
# shared server's 2048 tokens took a minute of CPU per test. 640 tokens still span two
# 512-token prefill steps and end on a block boundary, as 2048 did.
SHORT_CONTEXT = 640


@pytest.fixture(scope="module")
def short_http() -> Iterator[httpx.Client]:
    proc = ServerProcess("--max-model-len", str(SHORT_CONTEXT))
    try:
        with httpx.Client(base_url=proc.wait_ready().url, timeout=120) as c:
            yield c
    finally:
        proc.stop()


def offline_prompt_logprobs(llm, ids: list[int], k: int) -> list:  # noqa: ANN001
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
    return llm.generate([ids], params)[0].prompt_logprobs


def _top_k_and_chosen(position: dict, chosen: int, k: int) -> list[float]:
    """A legacy completion's `top_logprobs` values at one position, sorted: the k most likely
    and the chosen token ("up to logprobs + 1" entries, OpenAI's and vLLM's)."""
    values = {t: x.logprob for t, x in position.items() if x.rank <= k}
    values[chosen] = position[chosen].logprob
    return sorted(values.values())


def test_loglikelihood_requests_as_lm_eval_sends_them(http: httpx.Client, offline_llm) -> None:
    tok = offline_llm.engine.tokenizer
    context = tok.encode(CONTEXT)
    prompts = [context + tok.encode(c, add_special_tokens=False) for c in CONTINUATIONS]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 1,
                                            "temperature": 0, "logprobs": 1, "echo": True,
                                            "seed": 1234})
    assert r.status_code == 200, r.text
    totals = []
    for choice, ids in zip(r.json()["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = offline_prompt_logprobs(offline_llm, ids, 1)
        for pos in range(1, len(ids)):
            assert lp["token_logprobs"][pos] == pytest.approx(want[pos][ids[pos]].logprob,
                                                              abs=1e-5)
            assert max(lp["top_logprobs"][pos].values()) >= lp["token_logprobs"][pos] - 1e-6
        assert "".join(lp["tokens"][:len(ids)]) == tok.decode(ids, skip_special_tokens=False)
        totals.append(sum(lp["token_logprobs"][len(context):-1]))  # lm-eval's sum
    assert totals[0] > totals[1]  # the model prefers Paris


def test_max_tokens_0_scores_the_prompt_alone(http: httpx.Client, offline_llm) -> None:
    ids = offline_llm.engine.tokenizer.encode(CONTEXT + " Paris")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3}
    r = http.post("/v1/completions", json=body).json()
    [choice] = r["choices"]
    assert choice["text"] == offline_llm.engine.tokenizer.decode(ids)
    assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    want = offline_prompt_logprobs(offline_llm, ids, 3)
    for pos in range(1, len(ids)):
        top = choice["logprobs"]["top_logprobs"][pos]
        expected = _top_k_and_chosen(want[pos], ids[pos], 3)  # 3, or 4 beside a chosen 4th
        assert sorted(top.values()) == pytest.approx(expected, abs=1e-5)
    streamed = [line for line in http.post("/v1/completions", json={**body, "stream": True})
                .text.splitlines() if line.startswith("data: {")]
    assert len(streamed) == 1  # the whole answer is known at once
    [streamed_choice] = json.loads(streamed[0][6:])["choices"]
    assert streamed_choice["text"] == choice["text"]
    assert streamed_choice["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
    assert streamed_choice["finish_reason"] == "length"
    no_echo = http.post("/v1/completions", json={**body, "echo": False})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


def test_echo_with_generation_appends_the_generated_tokens(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": CONTEXT, "max_tokens": 4, "temperature": 0,
            "logprobs": 2, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    echoed = http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == CONTEXT + plain["text"]
    assert echoed["logprobs"]["tokens"][-4:] == plain["logprobs"]["tokens"]
    # the logits of every prompt row come from a larger matmul: float32 rounding apart
    assert echoed["logprobs"]["token_logprobs"][-4:] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert echoed["logprobs"]["text_offset"][-4] == len(CONTEXT)
    stream = http.post("/v1/completions", json={**body, "echo": True, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines()
              if line.startswith("data: {")]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == echoed["logprobs"]["tokens"]


def test_prompt_logprobs_extra_on_completions_and_chat(http: httpx.Client, offline_llm) -> None:
    ids = offline_llm.engine.tokenizer.encode(CONTEXT)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2,
                                            "n": 2, "prompt_logprobs": 2}).json()
    want = offline_prompt_logprobs(offline_llm, ids, 2)
    for choice in r["choices"]:  # each choice of the prompt carries them (vLLM's layout)
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for pos in range(1, len(ids)):
            assert set(got[pos]) == {str(t) for t in want[pos]}  # the token + the top 2
            actual = got[pos][str(ids[pos])]
            assert actual["logprob"] == pytest.approx(want[pos][ids[pos]].logprob, abs=1e-5)
            assert actual["rank"] == want[pos][ids[pos]].rank
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                   "max_tokens": 1, "prompt_logprobs": 0}).json()
    entries = chat["prompt_logprobs"]  # once per reply
    assert entries[0] is None and len(entries) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["decoded_token"] for e in entries[1:])
    streamed = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                       "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_echoed_token_prompt_keeps_its_special_tokens(http: httpx.Client, stream: bool) -> None:
    """A token-id prompt with a special token (1 is <|im_start|>) is echoed as the model saw
    it, as vLLM does; each text_offset is where its token starts in the text. The echo used
    to drop the special token while `tokens` kept it, so the generated tokens' offsets went
    back over the prompt's (text_offset [0, 0, ...])."""
    ids = [1] + http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1,
            "temperature": 0, "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        choices = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
                   if line.startswith("data: {")]
    else:
        choices = r.json()["choices"]
    text = "".join(c["text"] for c in choices)
    lp = {key: [x for c in choices for x in c["logprobs"][key]]
          for key in ("tokens", "text_offset")}
    assert text.startswith("<|im_start|>Hello"), text
    assert "".join(lp["tokens"][:len(ids)]) == "<|im_start|>Hello"
    starts = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == starts


def test_max_tokens_0_scores_a_prompt_filling_the_context(short_http: httpx.Client,
                                                         offline_llm) -> None:
    """echo with max_tokens 0 generates nothing, so a prompt of max_model_len tokens
    fits; it was a 400 (the engine runs one token past a prompt, and the check counted it)."""
    tok = offline_llm.engine.tokenizer
    ctx = SHORT_CONTEXT
    head = (tok.encode("The quick brown fox jumps over the lazy dog. " * 300))[:ctx - 1]
    # the reference: the offline engine's logprobs of every position, the last one included
    # (the sampled position of the prompt one token short); the last token is the second most
    # likely, so the score cannot come from a mask that left it the only choice
    ref = offline_llm.generate([head], SamplingParams(max_tokens=1, temperature=0,
                                                       logprobs=3, prompt_logprobs=3))[0]
    last_entry = ref.outputs[0].logprobs[0]
    last = next(t for t, lp in last_entry.items() if lp.rank == 2)
    ids = head + [last]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3}
    r = short_http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ctx, 0), usage
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == ctx
    want = [*ref.prompt_logprobs, last_entry]
    for pos in (1, ctx // 2, ctx - 2, ctx - 1):
        assert lp["token_logprobs"][pos] == pytest.approx(want[pos][ids[pos]].logprob,
                                                          abs=1e-4), pos
        assert sorted(lp["top_logprobs"][pos].values()) == pytest.approx(
            _top_k_and_chosen(want[pos], ids[pos], 3), abs=1e-4), pos
    assert lp["token_logprobs"][ctx - 1] < max(lp["top_logprobs"][ctx - 1].values())  # rank 2
    # streamed: the same single chunk
    stream = short_http.post("/v1/completions", json={**body, "stream": True})
    streamed = [line for line in stream.text.splitlines() if line.startswith("data: {")]
    assert len(streamed) == 1
    [streamed_choice] = json.loads(streamed[0][6:])["choices"]
    assert streamed_choice["logprobs"]["tokens"] == lp["tokens"]
    assert streamed_choice["logprobs"]["token_logprobs"][ctx - 1] == pytest.approx(
        lp["token_logprobs"][ctx - 1], abs=1e-4)
    # without logprobs: the echo alone; vLLM's prompt_logprobs extra: the last one too
    plain = short_http.post("/v1/completions",
                            json={**body, "logprobs": None, "prompt_logprobs": 1})
    assert plain.status_code == 200, plain.text
    [plain_choice] = plain.json()["choices"]
    assert plain_choice["text"] == choice["text"] and plain_choice["logprobs"] is None
    assert len(plain_choice["prompt_logprobs"]) == ctx
    assert plain_choice["prompt_logprobs"][ctx - 1][str(last)]["logprob"] == pytest.approx(
        lp["token_logprobs"][ctx - 1], abs=1e-4)
    # n > 1 and a batch beside a shorter prompt: each choice scores its own whole prompt
    r = short_http.post("/v1/completions", json={**body, "prompt": [ids, ids[:5]], "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [ctx, ctx, 5, 5]
    assert choices[1]["logprobs"]["token_logprobs"][ctx - 1] == pytest.approx(
        lp["token_logprobs"][ctx - 1], abs=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == ctx + 5
    # a token to generate still needs room past the prompt
    for extra in ({"max_tokens": 1}, {"max_tokens": 1, "echo": False}):
        r = short_http.post("/v1/completions", json={**body, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt", r.text
        assert err["code"] == "context_length_exceeded" and str(ctx) in err["message"], err
    # and past the context, max_tokens 0 is still refused
    r = short_http.post("/v1/completions", json={**body, "prompt": ids + [28]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_0_whole_context_streamed_with_n_2(short_http: httpx.Client) -> None:
    """Streamed, each of n choices of a prompt filling the context echoes it whole. The n
    sequences prefill one after the other (512-token steps on the CPU), so the first one
    finishes while its request does not: its chunk went out with the shortened prompt (the
    context less one token, the last one's logprob missing). Sampling fields change no prompt
    logprob."""
    ctx = SHORT_CONTEXT
    ids = short_http.post("/tokenize", json={
        "prompt": "The quick brown fox jumps over the lazy dog. " * 300}).json()["tokens"][:ctx]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    whole = short_http.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    want = whole.json()["choices"][0]["logprobs"]
    r = short_http.post("/v1/completions", json={**body, "n": 2, "stream": True,
                                                 "temperature": 1.5, "presence_penalty": 2,
                                                 "logit_bias": {str(ids[-1]): -100}})
    assert r.status_code == 200, r.text
    choices = [c for line in r.text.splitlines() if line.startswith("data: {")
               for c in json.loads(line[6:])["choices"]]
    assert sorted(c["index"] for c in choices) == [0, 1]
    for c in choices:
        lp = c["logprobs"]
        assert lp["tokens"] == want["tokens"] and len(lp["tokens"]) == ctx
        assert lp["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
        assert c["finish_reason"] == "length"
    # cut to the context by truncate_prompt_tokens -1: the same whole-context prompt
    cut = short_http.post("/v1/completions", json={**body, "prompt": [28] * 100 + ids,
                                                   "truncate_prompt_tokens": -1})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == ctx
    assert cut.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        want["token_logprobs"][1:], abs=1e-4)


@pytest.mark.parametrize("k", [0, 2])
def test_top_logprobs_hold_the_chosen_token_and_the_top_k(http: httpx.Client, offline_llm,
                                                           k: int) -> None:
    """Legacy completions return "up to logprobs + 1" entries per position (OpenAI; vLLM):
    the chosen token always, then the k most likely, so `logprobs: 0` is not `{}` and a
    sampled token outside the top k still shows. Echoed prompt tokens likewise."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "echo": True,
            "logprobs": k, "temperature": 1.5, "seed": 7}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    block = r.json()["choices"][0]["logprobs"]
    rows = list(zip(block["tokens"], block["token_logprobs"], block["top_logprobs"],
                    strict=True))[1:]  # the first prompt token has no logprob
    for token, logprob, top in rows:
        assert top[token] == pytest.approx(logprob)
        assert len(top) in ((k, k + 1) if k else (1,))
    # the generated positions: the engine's top k there, plus the chosen token
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=7, logprobs=k)
    [seq] = offline_llm.generate([body["prompt"]], params)[0].outputs
    for (_, _, top), token_id, entry in zip(rows[-len(seq.token_ids):], seq.token_ids,
                                            seq.logprobs, strict=True):
        assert sorted(top.values()) == pytest.approx(_top_k_and_chosen(entry, token_id, k),
                                                     abs=1e-4)
