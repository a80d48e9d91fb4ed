"""Structured outputs as users of vLLM / OpenAI write them, on the embedded model's real
tokenizer: specs found to be refused or mismatched in review."""

from __future__ import annotations

import pytest
from argosy_runtime import StructuredOutputsParams
from argosy_runtime.structured_output.grammar import GrammarCompiler


def _follows(compiler: GrammarCompiler, tokenizer, params: StructuredOutputsParams,  # noqa: ANN001
             text: str) -> tuple[bool, bool]:
    """(whether every token of `text` is allowed in turn, whether the output may end there)."""
    grammar = compiler.compile(params)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n, token in enumerate(ids):
        if not grammar.allowed_tokens(ids[:n])[token]:
            return False, False
    return True, bool(grammar.allowed_tokens(ids)[tokenizer.eos_token_ids[0]])


@pytest.mark.parametrize("grammar", [
    # Lark's JSON tutorial starts so: `?` inlines a rule that has one child
    '?start: value\n?value: pair | NUMBER\npair: "(" NUMBER "," NUMBER ")"\n'
    "%import common.NUMBER",
    '!start: "(" NUMBER "," NUMBER ")" | NUMBER\n%import common.NUMBER',  # `!` keeps tokens
])
def test_lark_grammars_with_a_prefixed_start_rule_are_lark(compiler, checkpoint,  # noqa: ANN001
                                                           grammar: str) -> None:
    params = StructuredOutputsParams(grammar=grammar)
    tok = checkpoint.tokenizer
    assert _follows(compiler, tok, params, "(3,14)") == (True, True)
    assert _follows(compiler, tok, params, "42") == (True, True)
    assert _follows(compiler, tok, params, "(3)")[0] is False
