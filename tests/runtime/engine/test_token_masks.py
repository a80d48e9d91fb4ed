"""allowed_token_ids and bad_words (vLLM's) in the engine, against transformers (float32).

The reference decodes greedily with transformers' own forward pass and masks each step's
logits itself: only the allowed ids survive, and a bad word's last token is -inf when the
tokens generated just before are the word's other tokens. The engine must pick the same
tokens, alone, with n > 1, with a grammar, under speculative decoding and on prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch
from argosy_runtime import LLMEngine, SamplingParams, StructuredOutputsParams
from engine_helpers import assert_no_leaks, run_requests

pytestmark = pytest.mark.slow  # loads the embedded model

STORY = "Once upon a time, there was a"
# Unconstrained greedy: " small town nestled in the heart of a bustling city. The town was ..."
SMALL, TOWN, COMMA, A = 1165, 3102, 28, 253  # " small", " town", ",", " a"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(model="smollm2-135m", dtype="float32")


def word_sequences(engine: LLMEngine, words: list[str]) -> list[list[int]]:
    """The sequences vLLM bans for `words`, spelled out independently of bad_words.py: the
    word alone, plus ' ' + word when that is as many tokens with another first token."""
    encode = engine.tokenizer.encode
    out = []
    for w in words:
        plain = encode(w, add_special_tokens=False)
        spaced = encode(" " + w, add_special_tokens=False)
        out.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return out


@torch.no_grad()
def reference(hf_model, engine: LLMEngine, prompt: list[int], max_tokens: int,
              allowed: list[int] | None = None, bad: list[list[int]] = (),
              constraint: StructuredOutputsParams | None = None) -> list[int]:
    """Greedy transformers decoding with the masks applied by hand (ignore_eos: runs
    max_tokens unless a grammar completes)."""
    grammar = engine.grammar_compiler.compile(constraint) if constraint else None
    out: list[int] = []
    past, step_input = None, torch.tensor([prompt])
    while len(out) < max_tokens:
        result = hf_model(step_input, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[0, -1].float().clone()
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = 0.0
            logits += keep
        for seq in bad:
            if len(seq) - 1 <= len(out) and out[len(out) - len(seq) + 1:] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        if grammar is not None:
            logits[~grammar.allowed_tokens(out)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if grammar is not None and grammar.is_done(out):
            break
        step_input = torch.tensor([[token]])
    return out


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def test_allowed_token_ids_greedy_is_the_argmax_over_the_set(engine, embedded_hf) -> None:
    prompt = engine.tokenizer.encode(STORY)
    free = reference(embedded_hf.model, engine, prompt, 8)
    allowed = [SMALL, TOWN, COMMA, A, 30, 2240, 13]  # 30 ".", 2240 " city"
    assert free[:2] == [SMALL, TOWN] and not set(free) <= set(allowed)
    want = reference(embedded_hf.model, engine, prompt, 8, allowed=allowed)
    [out] = run_requests(engine, [(prompt, greedy(8, allowed_token_ids=allowed))])
    assert out.outputs[0].token_ids == want
    assert set(want) <= set(allowed) and want != free
    assert_no_leaks(engine)


def test_allowed_token_ids_sampled_with_n_and_free_requests_beside(engine) -> None:
    allowed = [SMALL, TOWN, COMMA, A, 30, 2240]
    sampled = SamplingParams(n=4, seed=5, temperature=1.5, max_tokens=10, ignore_eos=True,
                             allowed_token_ids=allowed)
    free = greedy(10)
    masked, plain = run_requests(engine, [(STORY, sampled), (STORY, free)])
    texts = set()
    for seq in masked.outputs:
        assert set(seq.token_ids) <= set(allowed), seq.token_ids
        texts.add(tuple(seq.token_ids))
    assert len(texts) > 1  # really sampled
    assert not set(plain.outputs[0].token_ids) <= set(allowed)  # the mask stayed in its row
    assert_no_leaks(engine)


def test_bad_words_one_token_never_appear(engine, embedded_hf) -> None:
    prompt = engine.tokenizer.encode(STORY)
    [free] = run_requests(engine, [(prompt, greedy(24))])
    assert " town" in free.outputs[0].text and TOWN in free.outputs[0].token_ids
    bad = word_sequences(engine, ["town"])
    assert [TOWN] in bad  # " town" is one token: banned at every step
    [out] = run_requests(engine, [(prompt, greedy(24, bad_words=["town"]))])
    seq = out.outputs[0]
    assert "town" not in seq.text.lower() and not {t for s in bad for t in s} & set(seq.token_ids)
    assert seq.token_ids == reference(embedded_hf.model, engine, prompt, 24, bad=bad)
    assert_no_leaks(engine)


def test_a_multi_token_bad_word_bans_its_last_token_only_after_the_others(engine, embedded_hf
                                                                           ) -> None:
    prompt = engine.tokenizer.encode(STORY)
    bad = word_sequences(engine, ["small town"])
    assert [SMALL, TOWN] in bad  # " small town": two tokens, mid-text form
    [out] = run_requests(engine, [(prompt, greedy(24, bad_words=["small town"]))])
    seq = out.outputs[0]
    # " small" is still fine on its own, " town" too, just never right after " small".
    assert seq.token_ids[0] == SMALL and seq.token_ids[1] != TOWN
    assert "small town" not in seq.text
    assert seq.token_ids == reference(embedded_hf.model, engine, prompt, 24, bad=bad)
    # Only generated tokens count (vLLM's rule): a prompt ending in " small" may go on " town".
    [after] = run_requests(engine, [(STORY + " small", greedy(2, bad_words=["small town"]))])
    assert after.outputs[0].token_ids[0] == TOWN
    assert_no_leaks(engine)


def test_masks_with_a_grammar_and_with_logprobs(engine, embedded_hf) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Is the sky blue? Answer:"}], add_generation_prompt=True),
        add_special_tokens=False)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe later"])
    [free] = run_requests(engine, [(prompt, greedy(10, structured_outputs=choice))])
    answer = free.outputs[0].text
    assert answer == "no"
    bad = word_sequences(engine, [answer])
    params = greedy(10, structured_outputs=choice, bad_words=[answer], logprobs=2)
    [out] = run_requests(engine, [(prompt, params)])
    seq = out.outputs[0]
    assert seq.text in ("yes", "maybe later") and seq.finish_reason == "stop"
    assert seq.token_ids == reference(embedded_hf.model, engine, prompt, 10, bad=bad,
                                      constraint=choice)
    # Logprobs are the raw model's (vLLM's default logprobs_mode "raw_logprobs", as for
    # logit_bias): before the grammar, the ban and the allowed set.
    raw = embedded_hf.prompt_logprobs(prompt + seq.token_ids[:1])[-1]
    first, chosen = seq.logprobs[0], seq.token_ids[0]
    assert first[chosen].logprob == pytest.approx(float(raw[chosen]), abs=1e-3)
    assert first[chosen].rank == int((raw > raw[chosen]).sum()) + 1 > 1
    assert first[int(raw.argmax())].rank == 1
    assert_no_leaks(engine)


def test_speculative_decoding_keeps_masked_outputs_exact(engine) -> None:
    spec = LLMEngine(model="smollm2-135m", dtype="float32",
                     speculative={"method": "ngram", "num_speculative_tokens": 4,
                                  "adaptive": False})
    # A repeated text makes the n-gram proposer draft " town" after " small": the target
    # must reject it at every verified position, as the non-speculative engine never picks it.
    echo = "The small town. The small town. The small town. The small town. The"
    requests = [
        (echo, greedy(24, bad_words=["small town"])),
        (echo, greedy(24, bad_words=["town"])),
        (STORY, greedy(24, allowed_token_ids=[SMALL, TOWN, COMMA, A, 30, 2240])),
    ]
    want = [o.outputs[0].token_ids for o in run_requests(engine, requests)]
    got = [o.outputs[0].token_ids for o in run_requests(spec, requests)]
    assert got == want
    stats = spec.get_stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert TOWN not in got[1] and all(
        (a, b) != (SMALL, TOWN) for a, b in zip(got[0], got[0][1:]))
    assert_no_leaks(spec)


def test_prefix_cache_hits_change_nothing(engine) -> None:
    params = greedy(12, bad_words=["town"], allowed_token_ids=[SMALL, TOWN, COMMA, A, 30])
    long_prompt = STORY + " quiet village by the sea, far from any road, where nothing ever" \
                          " happened and everyone knew everyone else. In that village, a"
    [first] = run_requests(engine, [(long_prompt, params)])
    hits = engine.get_stats().prefix_cache_hits
    [again] = run_requests(engine, [(long_prompt, params)])
    assert engine.get_stats().prefix_cache_hits > hits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert TOWN not in first.outputs[0].token_ids
    assert_no_leaks(engine)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, r"allowed_token_ids\[1\]"),
    ({"allowed_token_ids": ["7"]}, r"allowed_token_ids\[0\]"),
    ({"allowed_token_ids": [True]}, r"allowed_token_ids\[0\]"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"bad_words": "town"}, "bad_words"),
    ({"bad_words": [""]}, r"bad_words\[0\]"),
    ({"bad_words": ["ok", "  "]}, r"bad_words\[1\]"),
    ({"bad_words": ["ok", 3]}, r"bad_words\[1\]"),
    ({"bad_words": [f"w{i}" for i in range(200)]}, "bad_words"),
])
def test_bad_values_name_the_field(kwargs, field) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_rejects_ids_outside_the_vocabulary_and_runs_the_rest(engine) -> None:
    engine.add_request("ok", STORY, greedy(4))
    vocab = engine.spec.vocab_size
    with pytest.raises(ValueError, match=r"allowed_token_ids.*outside the vocabulary"):
        engine.add_request("bad", STORY, greedy(4, allowed_token_ids=[5, vocab]))
    words = [f"word{i} thing{i}" for i in range(100)]  # up to 2 sequences each: > 128
    with pytest.raises(ValueError, match="bad_words"):
        engine.add_request("many", STORY, greedy(4, bad_words=words))
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["ok"]
    assert_no_leaks(engine)
