"""Structured outputs and logit_bias in the engine, against transformers (float32, greedy).

The reference decodes with transformers' own forward pass and masks each step's logits with
the grammar's token mask (whose exactness test_grammar.py checks against brute force), or adds
the logit bias: the engine must pick the same tokens while batching constrained and free
requests together, under preemption, and with speculative decoding.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from argosy_runtime import LLMEngine, SamplingParams, StructuredOutputsParams
from engine_helpers import assert_no_leaks, run_requests

pytestmark = pytest.mark.slow  # loads the embedded model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe later"]),
    StructuredOutputsParams(grammar='start: "(" expr ")"\nexpr: /[a-z]+/ (" + " /[a-z]+/)*'),
]
PROMPTS = [
    "Describe a person as JSON:",
    "Give the capital of France as a JSON object.",
    "My phone number is",
    "Is the sky blue? Answer:",
    "An expression in parentheses:",
]


def chat(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


@torch.no_grad()
def reference(hf_model, engine: LLMEngine, prompt: list[int], max_tokens: int,
              constraint: StructuredOutputsParams | None = None,
              logit_bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding with transformers, masked by a fresh grammar and/or biased; stops at
    EOS or when the grammar is done, as the engine does."""
    grammar = engine.grammar_compiler.compile(constraint) if constraint else None
    eos = set(engine.tokenizer.eos_token_ids)
    out: list[int] = []
    past = None
    step_input = torch.tensor([prompt])
    while len(out) < max_tokens:
        result = hf_model(step_input, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[0, -1].float().clone()
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        if grammar is not None:
            logits[~grammar.allowed_tokens(out)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token in eos or (grammar is not None and grammar.is_done(out)):
            break
        step_input = torch.tensor([[token]])
    return out


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Each request's first sequence (a CompletionOutput), in order."""
    return [out.outputs[0] for out in run_requests(engine, requests)]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(model="smollm2-135m", dtype="float32")


def test_constrained_and_free_requests_in_one_batch_equal_transformers(engine, embedded_hf
                                                                        ) -> None:
    # 5 constrained requests, 2 free ones, all in the same steps, in a KV pool so small that
    # requests get preempted and recomputed (the grammar must follow the output, not the steps).
    tight = LLMEngine(model="smollm2-135m", dtype="float32", block_size=16,
                      kv_cache_memory=9 * 30 * 2 * 3 * 64 * 4 * 16)
    prompts = [chat(engine, p) for p in PROMPTS]
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, structured_outputs=c))
                for p, c in zip(prompts, CONSTRAINTS, strict=True)]
    requests += [(prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                 (prompts[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    outputs = run(tight, requests)
    assert tight.get_stats().num_preemptions > 0
    for (prompt, params), out in zip(requests, outputs, strict=True):
        want = reference(embedded_hf.model, engine, prompt, params.max_tokens,
                         params.structured_outputs)
        assert out.token_ids == want, (params.structured_outputs, out.text)
    person = json.loads(outputs[0].text)
    jsonschema.validate(person, PERSON)
    assert outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outputs[1].text), dict)
    assert outputs[2].text[:3].isdigit() and outputs[2].text[3] == "-"
    assert outputs[3].text in ("yes", "no", "maybe later")
    assert outputs[4].text.startswith("(")
    assert_no_leaks(tight)


def test_speculative_decoding_keeps_constrained_outputs_exact(engine, embedded_hf) -> None:
    spec = LLMEngine(model="smollm2-135m", dtype="float32",
                     speculative={"method": "ngram", "num_speculative_tokens": 4,
                                  "adaptive": False})
    prompt = chat(engine, "List three people as JSON objects with name, age and city, "
                  'like {"name": "Ann", "age": 30, "city": "Paris"}.')
    schema = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    params = SamplingParams(max_tokens=120, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    [out] = run(spec, [(prompt, params)])
    assert spec.get_stats().spec_decode_num_accepted_tokens > 0  # the keys repeat: drafts pass
    assert out.token_ids == reference(embedded_hf.model, engine, prompt, 120,
                                      params.structured_outputs)
    jsonschema.validate(json.loads(out.text), schema)
    assert_no_leaks(spec)


def test_a_draft_model_keeps_constrained_outputs_whole(engine) -> None:  # noqa: ANN001
    """A draft model (here the target's whole copy) drafts under the grammar's masks, to the
    end of the output and past it (EOS): greedy and sampled requests still end "stop" with
    output matching the schema. Drafts after the token that completes the output used to be
    verified, and the matcher, fed EOS once stopped, failed the request mid-object."""
    spec = LLMEngine(model="smollm2-135m", dtype="float32", speculative={
        "method": "draft", "draft_layers": 30, "num_speculative_tokens": 3, "adaptive": False})
    prompt = chat(engine, "Invent a person, as JSON.")
    requests = [(prompt, SamplingParams(max_tokens=60, temperature=t, seed=s,
                                        structured_outputs=StructuredOutputsParams(json=PERSON)))
                for t, s in ((0.0, None), (0.8, 5), (0.8, 6), (1.0, 7))]
    outs = run(spec, requests)
    assert [o.finish_reason for o in outs] == ["stop"] * 4
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    stats = spec.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert outs[0].token_ids == run(engine, requests[:1])[0].token_ids
    assert_no_leaks(spec)


def test_sampled_outputs_match_the_schema(engine) -> None:
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=80, structured_outputs=(
        StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)))
    engine.add_request("s", chat(engine, "Invent a person, as JSON."), params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert len({o.text for o in final.outputs}) > 1  # really sampled
    for o in final.outputs:
        assert o.finish_reason == "stop", o.text
        value = json.loads(o.text)
        jsonschema.validate(value, PERSON)
        assert o.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # compact
    assert_no_leaks(engine)


def test_the_grammar_ending_ends_the_request_even_with_ignore_eos(engine) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    for extra in ({"ignore_eos": True}, {"min_tokens": 10}):
        params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=choice, **extra)
        [out] = run(engine, [(chat(engine, "Is water wet?"), params)])
        assert out.text in ("yes", "no") and out.finish_reason == "stop", extra
    # A grammar complete before any token (only the empty output matches): min_tokens banned
    # the EOS that is all it allows, and the request ended in "error".
    empty = StructuredOutputsParams(regex="a{0}")
    params = SamplingParams(max_tokens=5, temperature=0, structured_outputs=empty, min_tokens=1)
    [out] = run(engine, [(chat(engine, "Say nothing."), params)])
    assert (out.text, out.finish_reason) == ("", "stop")
    assert_no_leaks(engine)


def test_logit_bias_equals_transformers_with_the_bias_added(engine, embedded_hf) -> None:
    prompt = engine.tokenizer.encode("The capital of France is")
    free = reference(embedded_hf.model, engine, prompt, 6)
    banned = {free[0]: -100.0, free[1]: -100.0}
    forced = {engine.tokenizer.encode(" banana", add_special_tokens=False)[0]: 100.0}
    for bias in (banned, forced):
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=bias)
        [out] = run(engine, [(prompt, params)])
        assert out.token_ids == reference(embedded_hf.model, engine, prompt, 6,
                                          logit_bias=bias)
        assert out.token_ids != free
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True,
                             logit_bias=forced)
    [out] = run(engine, [(prompt, sampled)])
    assert out.token_ids == [next(iter(forced))] * 6  # +100 beats any logit


def test_bad_specs_are_rejected_at_add_request_and_disturb_nobody(engine) -> None:
    good = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("ok", "Hello", good)
    for rid, params in [
        ("regex", SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))),
        ("schema", SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "integer", "minimum": 3, "maximum": 1}))),
        ("bias", SamplingParams(logit_bias={10**6: 1.0})),
        # past llguidance's limits: caught by the compile-time probe, before any token (they
        # used to run one token and end as a normal "stop")
        ("huge_regex", SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="a{1000000}"))),
        ("huge_pattern", SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "string", "pattern": "^a{1000000}$"}))),
    ]:
        with pytest.raises(ValueError, match="structured_outputs|logit_bias"):
            engine.add_request(rid, "Hello", params)
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["ok"]
    assert_no_leaks(engine)


# Passes the compile-time probe, then fails once the output reaches the second item's huge
# `pattern` (llguidance: "lexer error: too many expressions constructed").
FAILS_MID_GENERATION = {"type": "array", "minItems": 2, "prefixItems": [
    {"type": "integer"}, {"type": "string", "pattern": "^a{1000000}$"}]}


def test_a_grammar_failing_mid_generation_ends_in_error_and_disturbs_nobody(engine) -> None:
    """The failed request ends with finish_reason "error" and says why (never "stop": its
    output does not match), its blocks go back to the pool, and a constrained and a free
    request in the same batches produce exactly what they produce alone."""
    bad = SamplingParams(max_tokens=40, temperature=0,
                         structured_outputs=StructuredOutputsParams(json=FAILS_MID_GENERATION))
    others = [
        ("My phone number is", SamplingParams(
            max_tokens=12, temperature=0,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))),
        (chat(engine, "Describe a person as JSON."), SamplingParams(
            max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(
                json=PERSON, disable_any_whitespace=True))),
        ("Hello", SamplingParams(max_tokens=24, temperature=0)),
    ]
    alone = run(engine, others)
    failed, *together = run(engine, [
        ("A list of a number and a string of a's in JSON:", bad), *others])
    assert failed.finish_reason == "error"
    assert failed.error.startswith("structured_outputs: the grammar failed after "
                                   f"{len(failed.token_ids)} generated token(s) (lexer error:")
    assert failed.text.startswith("[") and failed.text.endswith("a")  # the failing token
    for got, want in zip(together, alone, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
        assert got.error is None
    assert together[0].finish_reason == "stop" and together[0].text == "123-4567"
    jsonschema.validate(json.loads(together[1].text), PERSON)
    assert_no_leaks(engine)


def test_token_masks_excluding_the_grammar_say_so(engine) -> None:
    """allowed_token_ids with no digit under a digits-only regex: no token is allowed by both,
    the request fails, and its error points at the masks, not at the grammar's size."""
    letters = engine.tokenizer.encode("abc", add_special_tokens=False)
    params = SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=letters,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]+"))
    [failed] = run(engine, [("Count:", params)])
    assert failed.finish_reason == "error"
    assert "allowed_token_ids / bad_words may exclude every token" in failed.error, failed.error
    assert_no_leaks(engine)


def test_abort_mid_generation_frees_everything(engine) -> None:
    params = SamplingParams(max_tokens=64, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    engine.add_request("a", chat(engine, "A person as JSON:"), params)
    for _ in range(5):
        engine.step()
    engine.abort_request("a")
    assert_no_leaks(engine)


def count_steps(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("jf", prompt, params)
    steps, final = 0, None
    while engine.has_unfinished_requests():
        final = next(iter(engine.step()), final)
        steps += 1
    return final.outputs[0], steps


def test_jump_forward_saves_steps_and_changes_no_token(engine, embedded_hf) -> None:
    compact = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    prompt = chat(engine, "A person as JSON:")
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=compact)
    jumping, jump_steps = count_steps(engine, prompt, params)
    stepping = LLMEngine(model="smollm2-135m", dtype="float32", enable_jump_forward=False)
    plain, plain_steps = count_steps(stepping, prompt, params)
    assert jumping.token_ids == plain.token_ids == reference(
        embedded_hf.model, engine, prompt, 60, compact)
    assert plain_steps == len(plain.token_ids)  # one token per step without jumps
    # '{"name":"', '","age":', ',"city":"' are forced: a third of the tokens or more.
    assert jump_steps <= 2 * len(plain.token_ids) // 3, (jump_steps, len(plain.token_ids))
    # Logprobs need a forward pass per token: such requests never jump.
    with_logprobs = SamplingParams(max_tokens=60, temperature=0, structured_outputs=compact,
                                   logprobs=1)
    out, steps = count_steps(engine, prompt, with_logprobs)
    assert out.token_ids == plain.token_ids and len(out.logprobs) == len(out.token_ids)
    assert steps == len(out.token_ids)
    assert_no_leaks(engine)


@pytest.mark.parametrize(("greedy", "with_q", "cut"), [
    (True, False, True), (True, True, True),  # greedy: an invalid draft is simply wrong
    (False, False, True),  # one-hot q (n-gram): an invalid draft's residual is p itself
    (False, True, False),  # a draft model's q: the residual max(0, p - q) must stay exact
])
def test_drafts_are_cut_at_the_grammar_unless_that_would_bias_sampling(
        engine, greedy: bool, with_q: bool, cut: bool) -> None:
    from argosy_runtime.spec_decode.config import SpeculativeConfig
    from argosy_runtime.spec_decode.decoder import Proposal, SpeculativeDecoder

    digits = engine.tokenizer.encode("12", add_special_tokens=False)
    drafts = digits + engine.tokenizer.encode(" banana", add_special_tokens=False)

    class FixedProposer:  # proposes two digits, then a word the regex forbids
        def propose_batch(self, batch):  # noqa: ANN001, ANN202
            q = torch.full((len(drafts), engine.spec.vocab_size), 1 / engine.spec.vocab_size)
            return [Proposal(list(drafts), q if with_q else None) for _ in batch]

    params = SamplingParams(max_tokens=16, temperature=0 if greedy else 1.0, seed=3,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    engine.add_request("d", "Count:", params)
    engine.step()  # the prompt; the first digit is sampled
    decoder = SpeculativeDecoder(engine, SpeculativeConfig(num_speculative_tokens=4,
                                                           adaptive=False), FixedProposer())
    [req] = engine.scheduler.running
    decoder.propose([req])
    assert req.spec_token_ids == (digits if cut else drafts)
    engine.abort_request("d")
    assert_no_leaks(engine)
