"""Encoder-only models (models/bert.py): BERT and XLM-RoBERTa embeddings and cross-encoder
scores equal transformers' in float32 (1e-5), for batches of prompts of different lengths in
the same step (the bidirectional attention is per sequence), as sentence-transformers pools
them (modules.json / 1_Pooling / Normalize) or, without that config, vLLM's [CLS] default.
Also: sentence-transformers' other pooling modes (max, mean_sqrt_len_tokens, weightedmean,
lasttoken) equal its formulas over transformers' padded batch; a BERT cross-encoder's token
types are where transformers' tokenizer(text_1, text_2) puts them, even when a text holds the
literal [SEP] token; XLM-R's positions are transformers' create_position_ids_from_input_ids,
pad tokens inside a prompt included; truncate_prompt_tokens cuts a pair as
tokenizer(..., truncation=True, max_length=k); and the errors (generation, too-long prompts,
options an encoder refuses).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from argosy_runtime import LLM, LLMEngine, PoolingParams, SamplingParams
from engine_helpers import assert_no_leaks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from encoder_factory import encode, load_hf, make_encoder_dir  # noqa: E402
from st_pooling_reference import ST_MODES, st_pool  # noqa: E402

TEXTS = ["the cat sat on the mat", "hello", "what is the capital of france? paris is the city",
         "a dog", "hello world, hello berlin; germany is a country, berlin its capital city"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "a dog sat on the mat", "berlin",
        "the capital city of germany is berlin, the capital of france is paris"]
TOL = dict(atol=1e-5, rtol=1e-5)


@torch.no_grad()
def hf_hidden(hf, ids: list[int], types: list[int]) -> torch.Tensor:  # noqa: ANN001
    base = getattr(hf, "bert", None) or getattr(hf, "roberta", None) or hf
    return base(torch.tensor([ids]), token_type_ids=torch.tensor([types])).last_hidden_state[0]


def hf_embedding(hf, folder: Path, text: str, pooling: str, normalize: bool) -> torch.Tensor:  # noqa: ANN001
    ids, types = encode(folder, text)
    hidden = hf_hidden(hf, ids, types)
    vector = hidden[0] if pooling == "cls" else hidden.mean(dim=0)
    return F.normalize(vector, dim=0) if normalize else vector


@torch.no_grad()
def hf_logits(hf, folder: Path, text: str, pair: str | None = None) -> torch.Tensor:  # noqa: ANN001
    ids, types = encode(folder, text, pair)
    return hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("encoders")
    return {
        "bert_mean": make_encoder_dir(tmp, "bert", pooling="mean"),
        "bert_plain": make_encoder_dir(tmp, "bert", seed=1),  # no modules.json: CLS
        "bert_mlm": make_encoder_dir(tmp, "bert", masked_lm=True, seed=2),
        "bert_cls_raw": make_encoder_dir(tmp, "bert", pooling="cls", normalize=False, seed=3),
        "bert_ce": make_encoder_dir(tmp, "bert", classifier=True, seed=4),
        "xlmr": make_encoder_dir(tmp, "xlm_roberta", seed=5),
        "xlmr_ce": make_encoder_dir(tmp, "xlm_roberta", classifier=True, seed=6),
    }


def _llm(folder: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(model=str(folder), dtype="float32", **kwargs)


@pytest.mark.parametrize("key,pooling,normalize", [
    ("bert_mean", "mean", True),  # sentence-transformers mean + Normalize (all-MiniLM-L6-v2)
    ("bert_plain", "cls", True),  # no modules.json: vLLM's CLS, normalized (bge)
    ("bert_mlm", "cls", True),  # a BertForMaskedLM folder: its cls.* head skipped
    ("bert_cls_raw", "cls", False),  # CLS pooling, no Normalize module
    ("xlmr", "cls", True),  # bge-m3-like
])
def test_embeddings_match_transformers(folders: dict[str, Path], key: str, pooling: str,
                                       normalize: bool) -> None:
    folder = folders[key]
    llm, hf = _llm(folder), load_hf(folder)
    outs = llm.embed(TEXTS)  # one step: five lengths side by side
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)
    for text, out in zip(TEXTS, outs, strict=True):
        assert out.prompt_token_ids == encode(folder, text)[0]  # [CLS] ... [SEP] / <s> ... </s>
        expected = hf_embedding(hf, folder, text, pooling, normalize)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, **TOL)
    assert outs[0].embedding != outs[1].embedding
    # Explicit pooling parameters override the model's.
    other = "mean" if pooling == "cls" else "cls"
    [out] = llm.embed(TEXTS[2], PoolingParams(pooling=other, normalize=False))
    torch.testing.assert_close(torch.tensor(out.embedding),
                               hf_embedding(hf, folder, TEXTS[2], other, False), **TOL)
    assert_no_leaks(llm.engine)


def test_prompts_over_several_steps_stay_whole(folders: dict[str, Path]) -> None:
    """A token budget of one max-length prompt and two sequences a step: every prompt still
    runs whole (no chunking), equal-length prompts share a step (unpadded attention), a
    one-token prompt is a decode row, and repeated prompts are not served from a prefix
    cache (an encoder's K/V depend on later tokens)."""
    folder = folders["bert_mean"]
    llm = _llm(folder, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64)
    assert not llm.engine.cache_config.enable_prefix_caching
    assert not llm.engine.scheduler_config.enable_chunked_prefill
    ids = [encode(folder, t)[0] for t in TEXTS]
    prompts = ids + [ids[0], ids[0], [7], ids[4][:10] + ids[4][:10]]
    hf = load_hf(folder)
    outs = llm.embed(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        hidden = hf_hidden(hf, prompt, [0] * len(prompt))
        torch.testing.assert_close(torch.tensor(out.embedding),
                                   F.normalize(hidden.mean(dim=0), dim=0), **TOL)
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("key", ["bert_ce", "xlmr_ce"])
def test_cross_encoder_scores_match_transformers(folders: dict[str, Path], key: str) -> None:
    folder = folders[key]
    llm, hf = _llm(folder), load_hf(folder)
    scores = llm.score(QUERY, DOCS)
    for doc, score in zip(DOCS, scores, strict=True):
        expected = torch.sigmoid(hf_logits(hf, folder, QUERY, doc)[0]).item()
        assert score == pytest.approx(expected, abs=1e-6)
    assert len(set(scores)) == len(DOCS)
    types = encode(folder, QUERY, DOCS[0])[1]
    # BERT's pair template marks the document as type 1 (and the model sees that: the scores
    # above equal transformers' given those types); XLM-R has no token types.
    assert (1 in types) == (key == "bert_ce")
    outs = llm.classify(TEXTS)  # single texts: all type 0
    for text, out in zip(TEXTS, outs, strict=True):
        torch.testing.assert_close(torch.tensor(out.classification.logits),
                                   hf_logits(hf, folder, text), **TOL)
    assert_no_leaks(llm.engine)


def test_bert_pair_token_types_matter(folders: dict[str, Path]) -> None:
    """The reference with every token type 0 differs: the scores above really used type 1."""
    folder = folders["bert_ce"]
    hf = load_hf(folder)
    ids, types = encode(folder, QUERY, DOCS[0])
    with torch.no_grad():
        zero = hf(torch.tensor([ids]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long))
    [score] = _llm(folder).score(QUERY, DOCS[0])
    assert abs(torch.sigmoid(zero.logits[0, 0]).item() - score) > 1e-4


def test_xlmr_positions_and_context(folders: dict[str, Path]) -> None:
    engine = LLMEngine(model=str(folders["xlmr"]), dtype="float32")
    spec = engine.spec
    assert spec.position_offset == 2  # pad_token_id 1 + 1
    assert engine.max_model_len == 64 - 2


def test_errors(folders: dict[str, Path]) -> None:
    llm = _llm(folders["bert_mean"], max_model_len=32)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(["hello " * 40])
    with pytest.raises(ValueError, match="classification head"):
        llm.classify("hello")
    assert_no_leaks(llm.engine)
    ce = _llm(folders["bert_ce"])
    with pytest.raises(ValueError, match="classification and cross-encoder scores only"):
        ce.embed("hello")
    with pytest.raises(ValueError, match="classification and cross-encoder scores only"):
        ce.generate("hello")
    with pytest.raises(ValueError, match="leave pooling unset"):
        ce.engine.add_request("x", "hello", PoolingParams(task="classify", pooling="last"))
    for bad in ({"quantization": "int8"}, {"speculative": "ngram"},
                {"kv_cache_dtype": "int8"}):
        with pytest.raises(ValueError, match="encoder-only"):
            _llm(folders["bert_mean"], **bad)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # a prompt must fit a step
        _llm(folders["bert_mean"], max_num_batched_tokens=16)


def test_tokenizer_json_padding_and_truncation_are_off(folders: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A tokenizer.json saved padding and truncating to a fixed length (all-MiniLM-L6-v2's:
    128) encodes as transformers' tokenizer(text) does: neither."""
    import shutil

    from argosy_runtime.tokenizer import Tokenizer
    from tokenizers import Tokenizer as Backend

    folder = tmp_path / "padded"
    shutil.copytree(folders["bert_plain"], folder)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    backend.enable_truncation(max_length=16)
    backend.save(str(folder / "tokenizer.json"))
    assert len(backend.encode("hello").ids) == 16
    tokenizer = Tokenizer.from_hf_folder(folder)
    assert tokenizer.encode("hello") == encode(folders["bert_plain"], "hello")[0]
    assert len(tokenizer.encode(TEXTS[4])) > 16


def test_cls_pooling_is_for_encoders() -> None:
    llm = LLM(model="smollm2-135m", dtype="float32")
    with pytest.raises(ValueError, match="encoder-only"):
        llm.embed("hello", PoolingParams(pooling="cls"))
    assert_no_leaks(llm.engine)


def test_bfloat16_is_close_to_float32(folders: dict[str, Path]) -> None:
    folder = folders["xlmr"]
    full = _llm(folder).embed(TEXTS)
    half = LLM(model=str(folder), dtype="bfloat16").embed(TEXTS)
    for a, b in zip(full, half, strict=True):
        cosine = F.cosine_similarity(torch.tensor(a.embedding), torch.tensor(b.embedding), dim=0)
        assert cosine > 0.99


def hf_tokenizer(folder: Path):  # noqa: ANN201 (transformers' BertTokenizer / XLMRobertaTokenizer)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@torch.no_grad()
def hf_padded_batch(hf, folder: Path, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """transformers' last_hidden_state of `texts` run as one padded batch, and its mask: what
    sentence-transformers' Pooling module receives."""
    enc = hf_tokenizer(folder)(texts, padding=True, return_tensors="pt")
    base = getattr(hf, "bert", None) or getattr(hf, "roberta", None) or hf
    return base(**enc).last_hidden_state, enc["attention_mask"]


@pytest.mark.parametrize("mode", ["max", "mean_sqrt_len_tokens", "weightedmean", "last"])
def test_sentence_transformers_pooling_modes(folders: dict[str, Path], tmp_path: Path,
                                             mode: str) -> None:
    """The folder's 1_Pooling/config.json mode (no Normalize module: the raw vectors), and the
    same mode asked for on a model whose own pooling is [CLS] (XLM-R, normalized)."""
    folder = make_encoder_dir(tmp_path, "bert", pooling=mode, normalize=False, seed=7)
    llm = _llm(folder)
    assert llm.engine.spec.pooling_type == mode
    hidden, mask = hf_padded_batch(load_hf(folder), folder, TEXTS)
    expected = st_pool(hidden, mask, ST_MODES[mode][0])
    for out, want in zip(llm.embed(TEXTS), expected, strict=True):
        torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)
    assert_no_leaks(llm.engine)
    xlmr = folders["xlmr"]
    hidden, mask = hf_padded_batch(load_hf(xlmr), xlmr, TEXTS)
    expected = F.normalize(st_pool(hidden, mask, ST_MODES[mode][0]), dim=-1)
    outs = _llm(xlmr).embed(TEXTS, PoolingParams(pooling=mode))
    for out, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)


def test_concatenated_sentence_transformers_pooling_is_refused(tmp_path: Path) -> None:
    folder = make_encoder_dir(tmp_path, "bert", pooling="cls+mean")
    with pytest.raises(ValueError, match="concatenates several poolings"):
        _llm(folder)


# Pairs holding the tokenizer's literal [SEP]: it encodes to the [SEP] id, yet the token types
# follow the pair (the last two pairs have the same ids, with the boundary in two places).
SEP_PAIRS = [("what is [SEP] the capital", "paris [SEP] is the capital"),
             (QUERY, "a [SEP] dog [SEP]"), ("hello [SEP] world", "city"),
             ("hello", "world [SEP] city")]


@torch.no_grad()
def test_bert_pair_token_types_come_from_the_pair(folders: dict[str, Path]) -> None:
    folder = folders["bert_ce"]
    llm, hf, tok = _llm(folder), load_hf(folder), hf_tokenizer(folder)
    scores = llm.score([a for a, _ in SEP_PAIRS], [b for _, b in SEP_PAIRS])
    for (a, b), score in zip(SEP_PAIRS, scores, strict=True):
        enc = tok(a, b, return_tensors="pt")
        assert enc["input_ids"][0].tolist().count(tok.sep_token_id) > 2
        assert score == pytest.approx(torch.sigmoid(hf(**enc).logits[0, 0]).item(), abs=1e-6)
    same_ids = [tok(a, b)["input_ids"] for a, b in SEP_PAIRS[2:]]
    assert same_ids[0] == same_ids[1] and abs(scores[2] - scores[3]) > 1e-4
    # One text is all type 0 whatever it holds, as tokenizer(text) gives it.
    texts = ["hello [SEP] world", "[SEP] [SEP] a dog"]
    for text, out in zip(texts, llm.classify(texts), strict=True):
        enc = tok(text, return_tensors="pt")
        assert enc["token_type_ids"].sum() == 0
        torch.testing.assert_close(torch.tensor(out.classification.logits),
                                   hf(**enc).logits[0], **TOL)
    assert_no_leaks(llm.engine)


def test_token_type_start_errors(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="token_type_start must be a non-negative integer"):
        PoolingParams(task="classify", token_type_start=-1)
    bert = LLMEngine(model=str(folders["bert_ce"]), dtype="float32")
    with pytest.raises(ValueError, match="past the prompt"):
        bert.add_request("x", [2, 7, 3], PoolingParams(task="classify", token_type_start=4))
    xlmr = LLMEngine(model=str(folders["xlmr_ce"]), dtype="float32")
    with pytest.raises(ValueError, match="no second token type"):
        xlmr.add_request("x", [0, 7, 2], PoolingParams(task="classify", token_type_start=1))
    assert not bert.has_unfinished_requests() and not xlmr.has_unfinished_requests()


@torch.no_grad()
def test_xlmr_pad_tokens_inside_a_prompt(folders: dict[str, Path]) -> None:
    """transformers numbers XLM-R positions from pad_token_id + 1 counting only non-pad
    tokens, a pad token itself at pad_token_id (create_position_ids_from_input_ids): a pad
    id inside a prompt shifts every later position by one."""
    folder = folders["xlmr"]
    hf, pad = load_hf(folder), 1
    cat, hello = encode(folder, "the cat")[0], encode(folder, "hello world")[0]
    prompts = [cat[:2] + [pad] + cat[2:], [cat[0], pad] + hello[1:2] + [pad, pad] + hello[2:],
               encode(folder, TEXTS[0])[0]]
    outs = _llm(folder).embed(prompts, PoolingParams(pooling="mean", normalize=False))
    for ids, out in zip(prompts, outs, strict=True):
        want = hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, **TOL)
        if pad in ids:  # the test has teeth: positions 2, 3, ... whatever the ids
            plain = torch.arange(2, 2 + len(ids))[None]
            naive = hf(torch.tensor([ids]), position_ids=plain).last_hidden_state[0].mean(dim=0)
            assert (naive - want).abs().max() > 1e-3
    # The cross-encoder too (classify), prompts of different lengths in one step.
    folder = folders["xlmr_ce"]
    hf = load_hf(folder)
    outs = _llm(folder).classify(prompts)
    for ids, out in zip(prompts, outs, strict=True):
        torch.testing.assert_close(torch.tensor(out.classification.logits),
                                   hf(torch.tensor([ids])).logits[0], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("key", ["bert_ce", "xlmr_ce"])
def test_score_truncate_prompt_tokens(folders: dict[str, Path], key: str) -> None:
    """LLM.score(truncate_prompt_tokens=k) cuts each pair as vLLM does, with transformers'
    tokenizer(query, document, truncation=True, max_length=k): the longer text loses its end
    first, the special tokens stay."""
    folder = folders[key]
    llm, hf, tok = _llm(folder), load_hf(folder), hf_tokenizer(folder)
    docs = [DOCS[3], DOCS[0] + " " + DOCS[3], "berlin"]
    for k in (9, 14):
        scores = llm.score(QUERY, docs, truncate_prompt_tokens=k)
        for doc, score in zip(docs, scores, strict=True):
            enc = tok(QUERY, doc, truncation=True, max_length=k, return_tensors="pt")
            assert enc["input_ids"].shape[1] <= k
            want = torch.sigmoid(hf(**enc).logits[0, 0]).item()
            assert score == pytest.approx(want, abs=1e-6)
        whole = llm.score(QUERY, docs[:1])[0]
        assert scores[0] != pytest.approx(whole, abs=1e-4)  # the cut changed the score
    assert llm.score(QUERY, docs, truncate_prompt_tokens=-1) == llm.score(QUERY, docs)
    with pytest.raises(ValueError, match="cannot hold the prompt's special tokens"):
        llm.score(QUERY, docs, truncate_prompt_tokens=2)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or in"):
        llm.score(QUERY, docs, truncate_prompt_tokens=10_000)
    assert_no_leaks(llm.engine)
    with pytest.raises(ValueError, match="an embedding model's texts are not truncated"):
        _llm(folders["bert_mean"]).score(QUERY, docs, truncate_prompt_tokens=8)


def test_truncating_tokenizer_copies_are_bounded(folders: dict[str, Path]) -> None:
    """Each truncate_prompt_tokens value needs a truncating copy of the tokenizer (a whole
    vocabulary); a client sending many values grew the server by 8 MB each (1.7 GB for 200),
    kept for good. Only the most recently used few are kept, and a cut is the same after its
    copy was dropped and made again."""
    from argosy_runtime.tokenizer import TRUNCATING_COPIES

    llm = _llm(folders["bert_ce"])
    tok = llm.engine.tokenizer
    first = tok.encode_pair(QUERY, DOCS[0], max_length=9)
    for k in range(10, 10 + 3 * TRUNCATING_COPIES):
        assert len(tok.encode_pair(QUERY, DOCS[0], max_length=k)[0]) <= k
    assert len(tok._truncating_backends) == TRUNCATING_COPIES
    assert tok.encode_pair(QUERY, DOCS[0], max_length=9) == first
    assert len(tok._truncating_backends) == TRUNCATING_COPIES
