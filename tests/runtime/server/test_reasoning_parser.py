"""Reasoning parsers split a reply into its thinking and its answer, whole or streamed in
pieces of any size, and the pieces add up to the whole."""

from __future__ import annotations

import random

import pytest
from argosy_runtime.server.reasoning_parser import ReasoningStream, split_reasoning

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
