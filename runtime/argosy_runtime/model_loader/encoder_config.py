"""Encoder-only checkpoints (BERT, XLM-RoBERTa): `config.json` -> ModelSpec fields, the
sentence-transformers pooling a folder configures, and the weights under one naming.

Served architectures (`models/bert.py` runs them, bidirectional attention, pooling only):
- `BertModel` (sentence-transformers/all-MiniLM-L6-v2, BAAI/bge-*-en-v1.5, intfloat/e5-*-v2)
  and `BertForMaskedLM` folders (their `cls.*` head is skipped): embeddings;
- `BertForSequenceClassification` (cross-encoder/ms-marco-MiniLM-L-6-v2): the pooler (dense +
  tanh on [CLS]) then `classifier`;
- `XLMRobertaModel` (BAAI/bge-m3, intfloat/multilingual-e5-*): embeddings; position ids start
  at `pad_token_id + 1` (transformers' create_position_ids_from_input_ids for an unpadded
  input), so the usable context is `max_position_embeddings - pad_token_id - 1` (514 -> 512);
- `XLMRobertaForSequenceClassification` (BAAI/bge-reranker-v2-m3): `classifier.dense` + tanh
  + `classifier.out_proj` on <s>.

Pooling of an embedding model, as vLLM decides it: a sentence-transformers folder's
`modules.json` names a Pooling module whose `config.json` says `pooling_mode_cls_token`,
`pooling_mode_mean_tokens` or `pooling_mode_lasttoken` (vLLM's three), or
`pooling_mode_max_tokens`, `pooling_mode_mean_sqrt_len_tokens`,
`pooling_mode_weightedmean_tokens` (sentence-transformers' others, with its formulas; several
modes at once, which it concatenates, are refused), and the vectors are L2-normalized
when a Normalize module follows; without `modules.json`, [CLS] pooling, normalized (vLLM's
BERT/RoBERTa default). Any other module (Dense, LayerNorm, ...) is refused: it would change
the vector. `sentence_bert_config.json`'s `max_seq_length` is the context (vLLM's rule; a
longer input is refused where sentence-transformers cuts it), and its `do_lower_case` is
refused over a tokenizer that keeps case (sentence-transformers lowercases the inputs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from argosy_runtime.model_loader.hf_checkpoint import open_safetensors

# HF `architectures[0]` -> (our architecture name, is a sequence classifier).
ENCODER_HF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("bert", False),
    "BertForMaskedLM": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "XLMRobertaModel": ("xlm_roberta", False),
    "XLMRobertaForMaskedLM": ("xlm_roberta", False),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", True),
}
ENCODER_MODEL_TYPES: dict[str, str] = {"bert": "bert", "xlm-roberta": "xlm_roberta"}
ENCODER_ARCHITECTURES: frozenset[str] = frozenset({"bert", "xlm_roberta"})
# transformers' ACT2FN names the encoder MLP may use.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# sentence-transformers' Pooling config keys -> PoolingParams.pooling (the same formulas).
_ST_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                     "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens": "weightedmean"}
# The modules.json entries served: the encoder itself, its pooling, the L2 normalization.
_ST_SERVED_MODULES = ("Transformer", "Pooling", "Normalize")


def encoder_architecture(config: dict[str, Any]) -> tuple[str, bool] | None:
    """(architecture, is_classifier) of an encoder config, None for any other config."""
    for name in config.get("architectures") or []:
        if name in ENCODER_HF_ARCHITECTURES:
            return ENCODER_HF_ARCHITECTURES[name]
    if not config.get("architectures") and config.get("model_type") in ENCODER_MODEL_TYPES:
        return ENCODER_MODEL_TYPES[config["model_type"]], False
    return None


def encoder_spec_fields(config: dict[str, Any], architecture: str, is_classifier: bool
                        ) -> dict[str, Any]:
    """The ModelSpec keyword arguments of a BERT / XLM-RoBERTa config.json (labels and the
    checkpoint dtype are added by the caller)."""
    from argosy_runtime.model_loader.model_spec import _hf_matryoshka, config_float, config_int

    def need(key: str) -> int:
        return config_int(config, key)

    kind = config.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        raise ValueError(f"config.json: position_embedding_type {kind!r} is not supported "
                         "(absolute only)")
    if config.get("is_decoder"):
        # transformers' BERT / XLM-R layers then attend causally; ours attend both ways, so
        # serving it would silently give other vectors.
        raise ValueError(f"config.json: is_decoder=true (causal attention) is not supported "
                         f"for {architecture}: encoders attend bidirectionally")
    act = config.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for "
                         f"{architecture} (one of {', '.join(ENCODER_ACTIVATIONS)})")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if heads <= 0:  # before dividing by it
        raise ValueError(f"num_attention_heads must be a positive integer, got {heads}")
    if hidden % heads:
        raise ValueError(f"config.json: hidden_size ({hidden}) is not divisible by "
                         f"num_attention_heads ({heads})")
    # XLM-RoBERTa numbers positions from pad_token_id + 1: that many rows are never used.
    offset = config_int(config, "pad_token_id", 1) + 1 if architecture == "xlm_roberta" else 0
    max_positions = need("max_position_embeddings") - offset
    if max_positions < 2:
        raise ValueError(f"config.json: max_position_embeddings leaves {max_positions} "
                         "usable positions")
    # Absent: BERT's 2; null: none.
    type_vocab_size = config_int(config, "type_vocab_size", 0) if "type_vocab_size" in config else 2
    if type_vocab_size < 0:  # 0: no token-type embedding
        raise ValueError(f"config.json: type_vocab_size must be 0 or more, got {type_vocab_size}")
    return dict(
        architecture=architecture, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=config_float(config, "layer_norm_eps", 1e-12), rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=max_positions, tie_word_embeddings=False,
        attention_bias=True, bos_token_id=None, eos_token_ids=(), has_lm_head=False,
        hidden_act=act, type_vocab_size=type_vocab_size,
        position_offset=offset,
        # is_matryoshka / matryoshka_dimensions (config.json or --hf-overrides), as a decoder's
        matryoshka_dimensions=_hf_matryoshka(config),
    )


def sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool]:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json (vLLM's
    get_pooling_config): (None, True) when the folder has none (the model's default)."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None, True
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path}: expected a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    # Any other module (Dense: LaBSE's tanh projection, LayerNorm, a custom remote module)
    # changes the vector after pooling: serving the model without it is silently wrong.
    others = [t for t in types if not t.startswith("sentence_transformers.")
              or t.rsplit(".", 1)[-1] not in _ST_SERVED_MODULES]
    if others:
        raise ValueError(f"{modules_path}: sentence-transformers module(s) {others} are not "
                         f"supported (only {', '.join(_ST_SERVED_MODULES)})")
    normalize = any(t.endswith("models.Normalize") for t in types)
    pooling = next((m for m in modules if isinstance(m, dict)
                    and str(m.get("type", "")).endswith("models.Pooling")), None)
    if pooling is None:
        return None, normalize
    config_path = folder / str(pooling.get("path", "")) / "config.json"
    config = _read(config_path)
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object (got a {type(config).__name__})")
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return None, normalize
    if len(modes) > 1:  # sentence-transformers concatenates the vectors of several modes
        raise ValueError(f"{folder}: sentence-transformers pooling {modes} concatenates "
                         "several poolings, which is not supported (one mode only)")
    if modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"{folder}: sentence-transformers pooling {modes[0]} is not "
                         f"supported (one of {', '.join(_ST_POOLING_MODES)})")
    return _ST_POOLING_MODES[modes[0]], normalize


def sentence_transformers_max_seq_length(folder: Path, tokenizer: Any) -> int | None:
    """sentence_bert_config.json's `max_seq_length` (None: the folder has none):
    sentence-transformers cuts every input to it, and vLLM serves it as the model's length.
    ValueError for `do_lower_case: true` over a tokenizer that keeps case: sentence-transformers
    lowercases each text before tokenizing it, which this server does not."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    config = _read(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object (got a {type(config).__name__})")
    if config.get("do_lower_case") and (
            tokenizer.encode("Hello World") != tokenizer.encode("hello world")):
        raise ValueError(f"{path}: do_lower_case is true but the tokenizer keeps case; "
                         "sentence-transformers lowercases every input first, which is not "
                         "supported (lowercase the inputs, or use an uncased tokenizer)")
    value = config.get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path}: max_seq_length must be a positive integer, got {value!r}")
    return value


def resolve_encoder_spec(spec: Any, folder: Path, tokenizer: Any) -> Any:
    """`spec` with what lives beside config.json: the sentence-transformers pooling, and
    its max_seq_length as the context (all-MiniLM-L6-v2: 256 of 512 positions; a longer
    input is refused where sentence-transformers would silently cut it; the position rows
    past it are never read, models/bert.py drops them). (A cross-encoder's token types come
    from the tokenizer's pair encoding, per request.)"""
    import dataclasses

    pooling, normalize = sentence_transformers_pooling(folder)
    max_len = sentence_transformers_max_seq_length(folder, tokenizer)
    max_positions = spec.max_position_embeddings
    if max_len is not None:
        max_positions = min(max_positions, max_len)
    return dataclasses.replace(spec, pooling_type=pooling, pooling_normalize=normalize,
                               max_position_embeddings=max_positions)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


# Stored name -> ours: the encoder's own names without the `bert.` / `roberta.` prefix of a
# *For* checkpoint; old checkpoints' LayerNorm gamma/beta; the two classifier heads (BERT's
# pooler + classifier, XLM-R's classifier.dense + out_proj) as one `head`.
_PREFIXES = ("bert.", "roberta.")
_SKIPPED = re.compile(r"^(cls\.|lm_head\.|embeddings\.position_ids$)")


def encoder_weight_name(stored: str, spec: Any) -> str | None:
    """Our name for a stored tensor, or None for one the served model does not use (a masked
    LM head, the position_ids buffer, an embedding model's unused pooler)."""
    name = stored
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if _SKIPPED.match(name):
        return None
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
        "LayerNorm.beta", "LayerNorm.bias")
    if name.startswith("pooler."):
        if not spec.num_labels or spec.architecture != "bert":
            return None  # an embedding model's pooler: vLLM's embeddings do not use it
        return "head.dense." + name[len("pooler.dense."):]
    if spec.num_labels and name.startswith("classifier."):
        if spec.architecture == "bert":
            return "head.out_proj." + name[len("classifier."):]
        return "head." + name[len("classifier."):]
    return name


def iter_encoder_weights(files: list[Path], spec: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every weight of an encoder checkpoint (see models/bert.py for
    the names); the model checks that nothing is missing or unexpected."""
    for file in files:
        with open_safetensors(file) as f:
            for stored in f.keys():
                name = encoder_weight_name(stored, spec)
                if name is not None:
                    yield name, f.get_tensor(stored)
