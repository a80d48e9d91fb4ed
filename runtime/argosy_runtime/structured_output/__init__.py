"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or a grammar.

`StructuredOutputsParams` (vLLM's name and fields) says what the output must match; the engine
compiles it with llguidance (`GrammarCompiler`) into one `RequestGrammar` per sequence, whose
token bitmask the sampler applies to every step's logits.
"""

from argosy_runtime.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
