"""Random-weight BERT folders for the encoder benchmarks (speed does not depend on the
weights' values; no Hub download is needed).

    .venv/bin/python bench/make_bert.py /tmp/bert-base-rand
    .venv/bin/python bench/make_bert.py /tmp/minilm-ce-rand --cross-encoder

Default: bert-base's shape (12 layers, hidden 768, 12 heads, MLP 3072) as an embedding model
with a sentence-transformers modules.json of CLS pooling and Normalize, laid out like
BAAI/bge-base-en-v1.5. `--cross-encoder`: cross-encoder/ms-marco-MiniLM-L-6-v2's shape (6
layers, hidden 384, 12 heads, MLP 1536) as a one-label BertForSequenceClassification. Both
have 512 positions, a 30522-token vocabulary and the small WordPiece tokenizer of the
encoder tests (tests/runtime/encoder_factory.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, "tests/runtime")
import torch  # noqa: E402
import transformers  # noqa: E402
from encoder_factory import bert_tokenizer  # noqa: E402


def main(out: Path, cross_encoder: bool) -> None:
    shape = (dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1536) if cross_encoder
             else dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072))
    config = transformers.BertConfig(vocab_size=30522, num_attention_heads=12,
                                     max_position_embeddings=512, num_labels=1, **shape)
    torch.manual_seed(0)
    model_cls = transformers.BertForSequenceClassification if cross_encoder else transformers.BertModel
    model_cls(config).eval().save_pretrained(out)
    bert_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]"}))
    if cross_encoder:
        print(out)
        return
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
    main(Path(sys.argv[1]), "--cross-encoder" in sys.argv[2:])
