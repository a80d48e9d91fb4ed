"""Review fixes: chat template selection and rendering against transformers' apply_chat_template
(the reference vLLM's server follows), on the embedded model's tokenizer.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from argosy_runtime.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: model_factory

from model_factory import embedded_tokenizer_files  # noqa: E402

DEFAULT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TOOL_USE = ("<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n" + DEFAULT)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _folder(tmp_path: Path, config: dict, files: dict[str, str] | None = None) -> Path:
    """The embedded tokenizer.json with `config` as tokenizer_config.json and extra files."""
    embedded = embedded_tokenizer_files()
    (tmp_path / "tokenizer.json").write_bytes(embedded["tokenizer.json"])
    base = json.loads(embedded["tokenizer_config.json"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("layout", ["config_list", "template_files"])
def test_tool_use_template_is_used_with_tools_as_in_transformers(tmp_path: Path,
                                                                   layout: str) -> None:
    """Hermes 2 Pro / Hermes 3 / Command R ship named templates, "default" and "tool_use";
    transformers (and vLLM, through get_chat_template) render a request with tools through
    "tool_use". Argosy rendered it through "default", so the model never saw the tools."""
    from transformers import AutoTokenizer

    if layout == "config_list":
        folder = _folder(tmp_path, {"chat_template": [{"name": "default", "template": DEFAULT},
                                                      {"name": "tool_use", "template": TOOL_USE}]})
    else:  # how transformers saves several templates
        folder = _folder(tmp_path, {}, {"chat_template.jinja": DEFAULT,
                                        "additional_chat_templates/tool_use.jinja": TOOL_USE})
    ours, hf = Tokenizer.from_hf_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(ASK, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
        kwargs = {"tools": tools} if tools else {}
        assert ours.apply_chat_template(ASK, True, **kwargs) == expected
    assert "get_weather" in ours.apply_chat_template(ASK, True, tools=TOOLS)
    # A template set in the model's place (--chat-template) serves tool requests too (vLLM).
    ours.chat_template = DEFAULT
    assert "get_weather" not in ours.apply_chat_template(ASK, True, tools=TOOLS)
