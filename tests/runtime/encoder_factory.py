"""Tiny random BERT / XLM-RoBERTa folders for the encoder tests (models/bert.py).

`make_encoder_dir(tmp_path, "bert" | "xlm_roberta", classifier=..., pooling=...)` saves a
transformers model (2 layers, hidden 48, float32, random weights with randomized LayerNorms
and biases) beside a small tokenizer.json built with the `tokenizers` library: BERT's
WordPiece (lowercasing, `[CLS] A [SEP]` / `[CLS] A [SEP] B:1 [SEP]:1` post-processor) or an
XLM-R-like Unigram (`<s> A </s>` / `<s> A </s> </s> B </s>`). `pooling`
(any PoolingParams pooling: "cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean",
"last"; "a+b" sets both) writes a sentence-transformers modules.json + 1_Pooling/config.json
(+ a Normalize module when `normalize`). `load_hf` gives the transformers model back for references.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from st_pooling_reference import ST_MODES
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

WORDS = ["the", "capital", "of", "france", "is", "paris", "what", "a", "cat", "dog", "sat",
         "on", "mat", "query", "document", "hello", "world", "berlin", "germany", "city"]


def bert_tokenizer() -> Tokenizer:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = list(string.ascii_lowercase + string.digits) + list(".,?!'")
    # dict.fromkeys: "a" is a letter and a word; a repeated entry would leave a hole in the ids
    vocab = list(dict.fromkeys(
        specials + letters + WORDS + ["##" + c for c in string.ascii_lowercase + string.digits]))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(specials)
    return tok


def xlmr_tokenizer() -> Tokenizer:
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = ([(t, 0.0) for t in specials] + [("▁" + w, -2.0) for w in WORDS]
              + [("▁", -3.0)] + [(c, -5.0) for c in string.ascii_letters + string.digits + ".,?!'"])
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    # As the Hub's XLM-R tokenizer.json (and transformers 5's XLMRobertaTokenizer) has it: the
    # whitespace is dropped first, so "the <pad> cat" is "▁the <pad> ▁cat" with no lone "▁"
    # piece before <pad> (a bare Metaspace keeps the space before <pad> as one).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(specials)
    return tok


def make_encoder_dir(tmp_path: Path, arch: str = "bert", *, classifier: bool = False,
                     masked_lm: bool = False, pooling: str | None = None,
                     normalize: bool = True, seed: int = 0, max_positions: int = 64,
                     num_labels: int = 1) -> Path:
    import transformers

    tok = bert_tokenizer() if arch == "bert" else xlmr_tokenizer()
    prefix = "Bert" if arch == "bert" else "XLMRoberta"
    extra = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
             "type_vocab_size": 1} if arch == "xlm_roberta" else {}
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=tok.get_vocab_size(), hidden_size=48, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, max_position_embeddings=max_positions,
        num_labels=num_labels, **extra)
    cls = ("ForSequenceClassification" if classifier else "ForMaskedLM" if masked_lm
           else "Model")
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + cls)(config).eval()
    with torch.no_grad():  # randomize LayerNorms and biases too (transformers: 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.2)
    folder = tmp_path / f"{arch}-{cls}-{pooling}-{normalize}-{seed}"
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    specials = ({"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                 "unk_token": "[UNK]", "mask_token": "[MASK]"} if arch == "bert" else
                {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>",
                 "pad_token": "<pad>", "unk_token": "<unk>"})
    (folder / "tokenizer_config.json").write_text(json.dumps(specials))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        modes = pooling.split("+")  # "cls+mean": sentence-transformers' concatenation
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 48,
            **{key: name in modes for name, (_, key) in ST_MODES.items()}}))
    return folder


def load_hf(folder: Path):  # -> a transformers model, float32, eval
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()


def encode(folder: Path, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
    """(input ids, token type ids) as transformers' tokenizer(text, pair) gives them."""
    enc = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, pair)
    return enc.ids, enc.type_ids
