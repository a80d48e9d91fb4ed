"""A random-weight BERT-base-shaped embedding model folder for the encoder benchmarks.

    .venv/bin/python bench/make_bert_base.py /tmp/bert-base-rand

bert-base's shape (12 layers, hidden 768, 12 heads, MLP 3072, 512 positions, 30522-token
vocabulary) with random weights, the small WordPiece tokenizer of the encoder tests
(tests/runtime/encoder_factory.py: the benchmarks send token ids) and a sentence-transformers
modules.json with CLS pooling and Normalize, as BAAI/bge-base-en-v1.5 is laid out. Speed does
not depend on the weights' values; no Hub download is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, "tests/runtime")
import torch  # noqa: E402
import transformers  # noqa: E402
from encoder_factory import bert_tokenizer  # noqa: E402


def main(out: Path) -> None:
    config = transformers.BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072,
                                     max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(out)
    bert_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]"}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 768, "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False}))
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
