"""Review of the server's beam search replies (serving_beam_search.py), in process: the search
itself is stubbed (test_beam_search.py checks it against transformers), the reply built from
its hypotheses is real."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from argosy_runtime.beam_search import BeamSearchOutput, BeamSearchSequence
from argosy_runtime.server import serving_beam_search
from argosy_runtime.server.protocol import ChatCompletionRequest
from argosy_runtime.tokenizer import Tokenizer
from starlette.requests import Request

THOUGHT, ANSWER = "red is bright", "Red."


def _reply(folder: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> tuple[object, int]:
    """A chat beam search (width 1) on a server run with --reasoning-parser qwen3 whose one
    hypothesis thinks then answers: the reply, and the hypothesis's token count."""
    tok = Tokenizer.from_hf_folder(folder)
    prompt = tok.encode("Name a color.")
    generated = tok.encode(f"<think>{THOUGHT}</think>{ANSWER}", add_special_tokens=False)
    hypothesis = BeamSearchSequence(tokens=prompt + generated, text=tok.decode(generated),
                                    cum_logprob=-1.0, score=-1.0, finish_reason="length")

    async def search(*args: object, **kwargs: object) -> list[BeamSearchOutput]:
        return [BeamSearchOutput([hypothesis])]

    monkeypatch.setattr(serving_beam_search, "run_beam_search", search)
    ctx = SimpleNamespace(config=SimpleNamespace(reasoning_parser="qwen3"), tokenizer=tok,
                          engine=SimpleNamespace(max_waiting=0, max_num_seqs=8),
                          lifecycle=SimpleNamespace(enter=lambda: None, exit=lambda: None))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Name a color."}], n=1,
                                use_beam_search=True, stream=stream,
                                stream_options={"include_usage": True} if stream else None)
    request = Request({"type": "http", "headers": [], "state": {}})

    async def run() -> object:
        response = await serving_beam_search.beam_search_response(request, ctx, req, "m",
                                                                  [prompt], 16)
        if not stream:
            return json.loads(response.body)
        events = [e async for e in response.body_iterator]
        return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]  # [DONE] last

    return asyncio.run(run()), len(generated)


def test_chat_beam_search_splits_the_reasoning_as_a_sampled_reply(
        random_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --reasoning-parser a sampled chat reply's thinking is in reasoning_content (as
    vLLM's beam search chat reply's is); the beam search reply put it all in `content`,
    tags included, and its usage had no reasoning_tokens."""
    body, num_tokens = _reply(random_llama_dir, monkeypatch, stream=False)
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ANSWER,
                                 "reasoning_content": THOUGHT}
    reasoning_tokens = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens < num_tokens

    chunks, _ = _reply(random_llama_dir, monkeypatch, stream=True)
    [delta] = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert (delta["content"], delta["reasoning_content"]) == (ANSWER, THOUGHT)
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == reasoning_tokens
