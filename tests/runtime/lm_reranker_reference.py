"""A causal LM read as an LLM reranker, the reference side: Qwen3-Reranker's overrides and
prompt, and transformers' Qwen3ForCausalLM / tokenizer computing P(yes) = softmax over the
no/yes logits of the prompt's last token (shared by the loader and server tests)."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
                  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.",
        "Horses and cows are both animals"]
TEMPLATE = (Path(__file__).resolve().parents[2] / "docs" / "score_templates"
            / "qwen3_reranker.jinja")
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_reranker_prompt(query: str, document: str) -> str:
    """Qwen3-Reranker's prompt, written out as its model card builds it."""
    return ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
            "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
            "\"no\".<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {INSTRUCT}\n<Query>: {query}\n<Document>: {document}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


class Reference:
    """transformers' Qwen3ForCausalLM and tokenizer for a folder (float32)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.folder = folder
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))

    @torch.no_grad()
    def last_logits(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text)["input_ids"]
        return self.model(torch.tensor([ids])).logits[0, -1].float()

    def token(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def p_yes(self, text: str, no: str = "no", yes: str = "yes") -> float:
        logits = self.last_logits(text)
        return logits[[self.token(no), self.token(yes)]].softmax(dim=0)[1].item()
