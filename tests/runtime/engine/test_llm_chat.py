"""`LLM.chat` renders a conversation exactly as the server's chat route does (vLLM's
`LLM.chat` and its chat route agree too): same prompt token ids for the same messages."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from argosy_runtime import LLM, SamplingParams
from argosy_runtime.server.protocol import ChatMessage
from argosy_runtime.server.serving_chat import render_chat_text
from engine_helpers import assert_no_leaks

ONE = SamplingParams(max_tokens=1, temperature=0)
CALL = {"id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", kv_cache_memory=16 << 20, max_model_len=256)


def prompt_ids(llm: LLM, messages: list[dict], **kwargs: object) -> list[int]:
    return llm.chat(messages, ONE, **kwargs)[0].prompt_token_ids


def server_ids(llm: LLM, messages: list[dict], **kwargs: object) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = render_chat_text(SimpleNamespace(tokenizer=tokenizer),
                            [ChatMessage.model_validate(m) for m in messages], None,
                            kwargs.pop("add_generation_prompt", True), **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages,plain", [
    # OpenAI content parts: were a ValueError from inside the jinja template ("can only
    # concatenate str (not "list") to str"); the server joins them with a newline.
    ([{"role": "user", "content": [{"type": "text", "text": "Translate:"},
                                   {"type": "text", "text": "Good morning"}]}],
     [{"role": "user", "content": "Translate:\nGood morning"}]),
    # "developer" was rendered as a role the template does not know; the server sends "system".
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    # An assistant turn of tool calls, content None as OpenAI clients send it: was a
    # ValueError from the template; the server renders None as "".
    ([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": None, "tool_calls": [CALL]}],
     [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "tool_calls": [CALL]}]),
])
def test_chat_renders_as_the_server_does(llm, messages, plain) -> None:  # noqa: ANN001
    assert prompt_ids(llm, messages) == server_ids(llm, messages) == prompt_ids(llm, plain)
    assert_no_leaks(llm.engine)


def test_template_options_as_vllm_takes_them(llm) -> None:  # noqa: ANN001
    decode = llm.get_tokenizer().decode
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    ended = decode(prompt_ids(llm, chat, add_generation_prompt=False))
    assert ended.endswith("Hello the\n")  # the turn closed (its <|im_end|> decodes to "")
    assert prompt_ids(llm, chat, add_generation_prompt=False, continue_final_message=True) \
        == server_ids(llm, chat, add_generation_prompt=False, continue_final_message=True)
    assert decode(prompt_ids(llm, chat, add_generation_prompt=False,
                             continue_final_message=True)).endswith("Hello the")
    template = "{% for m in messages %}{{ m.role }}={{ m.content }}|{% endfor %}{{ extra }}"
    assert decode(prompt_ids(llm, chat, chat_template=template,
                             chat_template_kwargs={"extra": "!"})) == "user=Hi|assistant=Hello the|!"
    with pytest.raises(ValueError, match="^continue_final_message: .*cannot both be true"):
        llm.chat(chat, ONE, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^messages\[0\]: .*role"):
        llm.chat([{"role": "wizard", "content": "x"}], ONE)
    assert_no_leaks(llm.engine)


def test_a_batch_of_conversations_keeps_its_order(llm) -> None:  # noqa: ANN001
    batch = [[{"role": "user", "content": f"Count to {n}"}] for n in (3, 30, 300)]
    outs = llm.chat(batch, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                            for n in (1, 2, 3)])
    assert [o.prompt_token_ids for o in outs] == [prompt_ids(llm, c) for c in batch]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    # each output's prompt is its rendered conversation, as vLLM's (it was None)
    tokenizer = llm.get_tokenizer()
    assert [tokenizer.encode(o.prompt, add_special_tokens=False) for o in outs] == \
        [o.prompt_token_ids for o in outs]
    assert all(o.prompt.endswith("<|im_start|>assistant\n") for o in outs)
    assert_no_leaks(llm.engine)


def test_generate_takes_vllms_keyword_names(llm: LLM) -> None:
    """vLLM code calls generate(prompts, sampling_params=..., use_tqdm=False)."""
    params = SamplingParams(max_tokens=4, temperature=0)
    [by_name] = llm.generate(["The capital of France is"], sampling_params=params,
                             use_tqdm=False)
    [plain] = llm.generate(["The capital of France is"], params)
    assert by_name.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        llm.generate(["x"], params, sampling_params=params)
    assert_no_leaks(llm.engine)
