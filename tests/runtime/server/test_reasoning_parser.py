"""Reasoning parsers split a reply into its thinking and its answer, whole or streamed in
pieces of any size, and the pieces add up to the whole; usage counts the tokens of the thinking
(between the tags, as vLLM)."""

from __future__ import annotations

import random

import pytest
from argosy_runtime.server.reasoning_parser import (
    ReasoningStream,
    count_reasoning_tokens,
    reasoning_span,
    split_reasoning,
)

CASES = {  # reply -> (qwen3's split, deepseek_r1's split)
    "<think>\nI think.\n</think>\n\nThe answer.": (("I think.", "The answer."),
                                                   ("I think.", "The answer.")),
    "plain answer": ((None, "plain answer"), ("plain answer", "")),
    "<think>\ncut off by max_tokens": (("cut off by max_tokens", ""),
                                       ("cut off by max_tokens", "")),
    "\n\nopened in the prompt</think>\n\nAns": ((None, "\n\nopened in the prompt</think>\n\nAns"),
                                                 ("opened in the prompt", "Ans")),
    "<thinking is not a tag": ((None, "<thinking is not a tag"),
                               ("<thinking is not a tag", "")),
    "<think></think>Hi": (("", "Hi"), ("", "Hi")),
    "a < b </think> c": ((None, "a < b </think> c"), ("a < b", "c")),
    " <think> x </thi": (("x </thi", ""), ("x </thi", "")),
    "<think>a</think>b</think>c": (("a", "b</think>c"), ("a", "b</think>c")),
    "": ((None, ""), ("", "")),
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", list(CASES))
def test_whole_and_streamed_replies_split_alike(parser: str, text: str) -> None:
    expected = CASES[text][parser == "deepseek_r1"]
    assert split_reasoning(parser, text) == expected
    for seed in range(25):
        rng = random.Random(seed)
        stream, reasoning, answer, i = ReasoningStream(parser), "", "", 0
        while True:
            j = min(len(text), i + rng.randint(1, 5))
            r, a = stream.feed(text[i:j], finished=j == len(text))
            reasoning, answer, i = reasoning + r, answer + a, j
            if i == len(text):
                break
        assert (reasoning, answer) == (expected[0] or "", expected[1]), seed


def test_nothing_is_sent_that_a_tag_could_still_take_back() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi", False) == ("", "")  # may become <think>: held
    assert stream.feed("nk>\nstep one", False) == ("step one", "")
    assert stream.feed(" </thi", False) == ("", "")  # may become </think>: held
    assert stream.feed("nk>\n\nDone", False) == ("", "Done")
    assert ReasoningStream("qwen3").feed("Hello <", False) == ("", "Hello <")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", list(CASES))
def test_the_span_holds_what_split_reasoning_returns(parser: str, text: str) -> None:
    reasoning = split_reasoning(parser, text)[0]
    span = reasoning_span(parser, text)
    assert (span is None) == (reasoning is None)
    if span is not None:
        assert text[span[0]:span[1]].strip() == reasoning


def _count(parser: str, tokens: list[str]) -> int:
    """`tokens`: each token's text ("" for one whose bytes end in a later token's)."""
    ends = [sum(map(len, tokens[:i + 1])) for i in range(len(tokens))]
    return count_reasoning_tokens(parser, "".join(tokens), ends)


@pytest.mark.parametrize("tokens, qwen3, deepseek_r1", [
    # the scripted reply of test_reasoning_api: the template opened <think>; EOS last
    ([" let", " me", " see", "</", "think", ">", "\n\n", "The", " answer", ""], 0, 3),
    (["<think>", "\n", "a", " b", "\n", "</think>", "\n\n", "c"], 4, 4),
    (["<", "think", ">", "a", " b</", "think", ">c"], 2, 2),  # " b</" carries thinking
    (["<think>", "", "é", "</think>"], 2, 2),  # a character over two tokens: both
    (["<think>", "cut", " off"], 2, 2),  # max_tokens inside the thinking
    (["<think>", "</think>", "Hi"], 0, 0),
    (["plain", " answer"], 0, 2),
    ([], 0, 0),
])
def test_reasoning_tokens_are_those_between_the_tags(tokens: list[str], qwen3: int,
                                                      deepseek_r1: int) -> None:
    assert (_count("qwen3", tokens), _count("deepseek_r1", tokens)) == (qwen3, deepseek_r1)
