"""Speculative decoding: cheap proposals, checked by the target model in one forward pass.

The output is exactly what the target model alone would produce: greedy requests accept a
draft token only if it equals the target's argmax; sampled requests use rejection sampling,
which preserves the target distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from argosy_runtime.spec_decode.config import SpeculativeConfig
from argosy_runtime.spec_decode.decoder import SpeculativeDecoder

if TYPE_CHECKING:
    from argosy_runtime.engine import LLMEngine
    from argosy_runtime.models.llama import LlamaForCausalLM

__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "build_proposer"]


def build_proposer(engine: LLMEngine, config: SpeculativeConfig,
                   draft_model: LlamaForCausalLM | None = None) -> SpeculativeDecoder:
    """`draft_model`: a separate draft, loaded before the KV cache was sized
    (draft_proposer.load_draft_model)."""
    if config.method == "ngram":
        from argosy_runtime.spec_decode.ngram_proposer import NgramProposer

        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from argosy_runtime.spec_decode.draft_proposer import DraftProposer

        proposer = DraftProposer(engine, config, draft_model)
    return SpeculativeDecoder(engine, config, proposer)
