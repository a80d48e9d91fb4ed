"""`ModelSpec`: the architecture hyperparameters the model forward needs, whatever the file format.

Built from a Hugging Face `config.json` (`ModelSpec.from_hf_config`) or from a GGUF file's
metadata (`argosy_runtime.model_loader.gguf_checkpoint.spec_from_gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF `architectures[0]` -> our architecture name. Mistral and Qwen2 share Llama's block
# structure (pre-norm, rotary, SwiGLU, GQA); Qwen2 adds a bias to the q/k/v projections.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
# The bare decoders, without a language-model head: how decoder-based embedding models are
# published (intfloat/e5-mistral-7b-instruct is a `MistralModel`). Their output is the final
# hidden state; their weights are named without the `model.` prefix.
HEADLESS_HF_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# Sequence classifiers (reward models, classifiers, cross-encoder rerankers): the decoder
# (`model.*`) plus a `score` linear [num_labels, hidden] read at the last token, no lm_head.
CLASSIFIER_HF_ARCHITECTURES: frozenset[str] = frozenset(
    {"LlamaForSequenceClassification", "MistralForSequenceClassification",
     "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification"})
# HF `model_type` -> our architecture name, for configs that omit `architectures`.
HF_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                                  "qwen3": "qwen3"}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of a decoder-only Llama-family model.

    `rope_scaling` is the HF config's rope scaling dict (always with a `rope_type` key), or None
    for plain rotary embeddings. `checkpoint_dtype` is the dtype of the floating point tensors
    `Checkpoint.iter_weights` yields ("float32" for GGUF, which is dequantized).
    `has_lm_head` is False for a headless checkpoint (`LlamaModel`, `MistralModel`,
    `Qwen2Model`: an embedding model): no lm_head weight, no logits, hidden states only; such
    a spec is never `tie_word_embeddings` (there is no head to tie).
    `id2label` is set for a sequence-classification checkpoint (`LlamaForSequenceClassification`
    etc.): its labels in class order, one per row of the `score` head that replaces the lm_head
    (so `has_lm_head` is False); empty for every other checkpoint.
    `sliding_window` is the attention window of a sliding-window checkpoint (Mistral-7B v0.1,
    Qwen2 with `use_sliding_window`), or None. Argosy attends to the whole context; that equals
    the window while a sequence fits in it, so `context_limit` stops there.
    `matryoshka_dimensions` says whether an embedding may be shortened (the `dimensions` of an
    embeddings request): None for a model not trained for it (its hidden size only), `()` for
    any size up to hidden_size (config.json `is_matryoshka: true`), else the sizes listed in
    `matryoshka_dimensions` (vLLM's config fields for Matryoshka Representation Learning).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str
    has_lm_head: bool = True
    sliding_window: int | None = None
    id2label: tuple[str, ...] = ()
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.checkpoint_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"checkpoint_dtype must be one of {_FLOAT_DTYPES}, got {self.checkpoint_dtype!r}"
            )
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if not self.has_lm_head and self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings needs an lm_head to tie; has_lm_head is False")
        if any(not 1 <= d <= self.hidden_size for d in self.matryoshka_dimensions or ()):
            raise ValueError(f"matryoshka_dimensions must lie in 1..hidden_size "
                             f"({self.hidden_size}), got {list(self.matryoshka_dimensions)}")
        if self.id2label and self.has_lm_head:
            raise ValueError("id2label (a classification head) replaces the lm_head; "
                             "has_lm_head must be False")

    def accepts_embedding_dimensions(self, dimensions: int) -> bool:
        """Whether an embedding may be cut to its first `dimensions` values (then normalized):
        the full size always; a shorter one only for a Matryoshka-trained model."""
        if dimensions == self.hidden_size:
            return True
        if self.matryoshka_dimensions is None:
            return False
        return 1 <= dimensions < self.hidden_size and (
            not self.matryoshka_dimensions or dimensions in self.matryoshka_dimensions)

    @property
    def num_labels(self) -> int:
        """Rows of the classification head (0: not a sequence-classification checkpoint)."""
        return len(self.id2label)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each query and key head (RMSNorm over head_dim, its own weight
        per layer) before the rotary embedding; the other architectures do not."""
        return self.architecture == "qwen3"

    @property
    def context_limit(self) -> int:
        """The longest sequence this model runs exactly: its trained context, and no more than
        its attention window. A token at position p of a sliding-window model sees only the
        last `sliding_window` positions (p - window, p]; Argosy's attention sees all of them,
        which is the same thing only while p < window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any],
        *,
        checkpoint_dtype: str,
        generation_config: dict[str, Any] | None = None,
    ) -> ModelSpec:
        """Parse a Hugging Face `config.json` dict (transformers 4.x or 5.x layout).

        `generation_config` (the folder's `generation_config.json`) contributes extra EOS ids:
        instruct models often stop on a token (e.g. `<|eot_id|>`) that config.json lacks.
        """
        architecture, has_lm_head, is_classifier = _hf_architecture(config)
        hidden_size = _require_int(config, "hidden_size")
        num_heads = _require_int(config, "num_attention_heads")
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"config.json: hidden_size ({hidden_size}) is not divisible by "
                    f"num_attention_heads ({num_heads}) and head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        if config.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (silu only)")
        rope_theta, rope_scaling = _hf_rope(config)
        # Qwen2's config has no attention_bias field: its q/k/v projections always have a bias.
        attention_bias = True if architecture == "qwen2" else bool(config.get("attention_bias", False))
        eos_ids = _as_id_list(config.get("eos_token_id"))
        if generation_config is not None:
            eos_ids += _as_id_list(generation_config.get("eos_token_id"))
        bos = config.get("bos_token_id")
        if bos is None and generation_config is not None:
            bos = generation_config.get("bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=_require_int(config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require_int(config, "intermediate_size"),
            num_hidden_layers=_require_int(config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            # Headless configs may still say tie_word_embeddings (a transformers default):
            # without a head there is nothing to tie.
            tie_word_embeddings=has_lm_head and bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            checkpoint_dtype=checkpoint_dtype,
            has_lm_head=has_lm_head,
            sliding_window=_hf_sliding_window(config, architecture),
            id2label=_hf_labels(config) if is_classifier else (),
            matryoshka_dimensions=_hf_matryoshka(config),
        )


def _hf_architecture(config: dict[str, Any]) -> tuple[str, bool, bool]:
    """(our architecture name, whether the checkpoint has an lm_head, whether it has a
    sequence-classification head instead)."""
    names = config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            is_classifier = name in CLASSIFIER_HF_ARCHITECTURES
            has_lm_head = name not in HEADLESS_HF_ARCHITECTURES and not is_classifier
            return HF_ARCHITECTURES[name], has_lm_head, is_classifier
    if not names and config.get("model_type") in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[config["model_type"]], True, False
    found = names[0] if names else config.get("model_type")
    raise ValueError(
        f"config.json: unsupported architecture {found!r}; supported: "
        f"{', '.join(HF_ARCHITECTURES)} (model_type {', '.join(HF_MODEL_TYPES)})"
    )


def _hf_labels(config: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels in class order. transformers writes `id2label` ({"0": "neg", ...});
    without it the head has `num_labels` classes (transformers' default: 2) named LABEL_i."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except ValueError as exc:
            raise ValueError(f"config.json: id2label keys must be class indices: {exc}") from exc
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"config.json: id2label must number the classes 0..{len(by_index) - 1}, "
                             f"got {sorted(by_index)}")
        return tuple(by_index[i] for i in range(len(by_index)))
    num_labels = int(config.get("num_labels") or 2)
    if num_labels < 1:
        raise ValueError(f"config.json: num_labels must be positive, got {num_labels}")
    return tuple(f"LABEL_{i}" for i in range(num_labels))


def _hf_matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    """`matryoshka_dimensions` (the sizes listed), else `is_matryoshka` (any size), else None."""
    listed = config.get("matryoshka_dimensions")
    if listed:
        if not isinstance(listed, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in listed):
            raise ValueError(f"config.json: matryoshka_dimensions must be a list of integers, "
                             f"got {listed!r}")
        return tuple(sorted(set(listed)))
    return () if config.get("is_matryoshka") else None


def _hf_sliding_window(config: dict[str, Any], architecture: str) -> int | None:
    """The attention window if any layer of this checkpoint attends through one, else None.

    Mistral windows every layer when `sliding_window` is set (v0.1: 4096; v0.2 on: null).
    Qwen2/Qwen3 window only with `use_sliding_window`, and then only layers from
    `max_window_layers` on. An explicit `layer_types` list (transformers 5) says it per layer.
    Llama has no window.
    """
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        slides = "sliding_attention" in layer_types
    elif architecture == "mistral":
        slides = True
    elif architecture in ("qwen2", "qwen3"):
        num_layers = int(config.get("num_hidden_layers", 0))
        slides = bool(config.get("use_sliding_window")) and int(
            config.get("max_window_layers", num_layers)) < num_layers
    else:
        slides = False
    return int(window) if slides else None


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout.

    transformers 4.x writes `rope_theta` and `rope_scaling`; 5.x writes one `rope_parameters`
    dict holding `rope_theta`, `rope_type` and the scaling fields.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _require_int(config: dict[str, Any], key: str) -> int:
    if key not in config:
        raise ValueError(f"config.json: missing required field {key!r}")
    return int(config[key])


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
