"""SentencePiece-style (Metaspace, "▁") tokenizer.json folders against transformers, on text
with special tokens in it: at the start, in the middle, at the end, next to spaces, and as
chat templates render them.

transformers 5 does not take these classes' normalizer / pre-tokenizer from tokenizer.json:
XLMRobertaTokenizer, LlamaTokenizer... rebuild them in Python and keep only the file's
vocabulary (and merges, post-processor). We load tokenizer.json as it is, so the two agree
exactly when the file holds what the class builds, which is what the Hub ships: XLM-R's
WhitespaceSplit + Metaspace(always), non-legacy Llama's Metaspace(first, split=False)."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from argosy_runtime.tokenizer import Tokenizer
from tokenizers import (
    AddedToken,
    SentencePieceBPETokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as BackendTokenizer

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: encoder_factory

from encoder_factory import xlmr_tokenizer  # noqa: E402


def _texts(specials: list[str]) -> list[str]:
    texts = ["the cat", "  the  cat  ", "the\ncat"]
    for s in specials:
        texts += [f"{s}the cat", f"{s} the cat", f"the {s} cat", f"the{s}cat", f"the {s}",
                  f"the {s} ", f"{s}{s}the", f"the  {s}  cat"]
    return texts


def _assert_same(folder: Path, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_folder(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in texts:
        for add in (True, False):
            ids = theirs.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, (
                text, add, ours.convert_ids_to_tokens(ours.encode(text, add_special_tokens=add)),
                theirs.convert_ids_to_tokens(ids))
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
                ids, skip_special_tokens=False), (text, ids)


def test_xlm_roberta_special_tokens_match_transformers(tmp_path: Path) -> None:
    # encoder_factory's XLM-R tokenizer once had a bare Metaspace: "the <pad> cat" was
    # "▁the","▁","<pad>","▁cat" here but "▁the","<pad>","▁cat" in transformers.
    tok = xlmr_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "XLMRobertaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    _assert_same(tmp_path, _texts(["<s>", "</s>", "<pad>"]))


def _corpus() -> list[str]:
    import collections
    import pathlib

    return [inspect.getdoc(m) or "" for m in (collections, json, pathlib, inspect)] * 3


LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def test_llama_non_legacy_special_tokens_match_transformers(tmp_path: Path) -> None:
    """A Llama-2 / Mistral-style tokenizer.json as the Hub ships it for legacy=false (byte
    fallback BPE, no normalizer, Metaspace(first, split=False)), with [INST] / [/INST] as
    special tokens (Mistral v0.3)."""
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(_corpus(), vocab_size=600, min_frequency=2, show_progress=False)
    pieces = [p for p, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    vocab = {t: i for i, t in enumerate(
        specials + [f"<0x{b:02X}>" for b in range(256)] + [p for p in pieces if p not in specials])}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(trainer._tokenizer.to_str())["model"]["merges"]]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                          fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True,
        "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": LLAMA2_TEMPLATE}))
    chat = Tokenizer.from_hf_folder(tmp_path).apply_chat_template([
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "How are you?"}])
    assert chat.startswith("<s>[INST] Hello there [/INST] Hi </s><s>[INST]")
    _assert_same(tmp_path, _texts(["<s>", "</s>", "[INST]", "[/INST]"]) + [chat])
