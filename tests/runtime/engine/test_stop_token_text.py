"""The model's end token that stops a request is not part of its text, also when special
tokens are kept (skip_special_tokens=False, which the mistral tool-call parser needs for its
[TOOL_CALLS] marker), as in vLLM; other special tokens the model writes stay. Unless the
request asks for its stop in the output (include_stop_str_in_output), as in vLLM too."""

from __future__ import annotations

import pytest
from argosy_runtime import LLM, SamplingParams
from model_factory import make_scripted_model_dir

# "Hi", " there" then <|im_start|> (1, a control token) and "!", after "\n" (198).
SCRIPT = [26843, 665, 1, 17]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_scripted_model_dir(tmp_path_factory.mktemp("models"), 198, SCRIPT)
    return LLM(model=str(folder), dtype="float32")


@pytest.mark.parametrize(("skip", "text"), [(True, "Hi there!"),
                                            (False, "Hi there<|im_start|>!")])
def test_the_end_token_is_no_text(llm: LLM, skip: bool, text: str) -> None:
    [out] = llm.generate([[198]], SamplingParams(temperature=0, max_tokens=20,
                                                 skip_special_tokens=skip))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 2  # <|im_end|> ended it ...
    assert out.outputs[0].text == text  # ... and is not in the text


@pytest.mark.parametrize(("skip", "text"), [(True, "Hi there!"),
                                            (False, "Hi there<|im_start|>!<|im_end|>")])
def test_the_end_token_is_text_when_the_stop_is_asked_for(llm: LLM, skip: bool,
                                                          text: str) -> None:
    [out] = llm.generate([[198]], SamplingParams(temperature=0, max_tokens=20,
                                                 skip_special_tokens=skip,
                                                 include_stop_str_in_output=True))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == text
