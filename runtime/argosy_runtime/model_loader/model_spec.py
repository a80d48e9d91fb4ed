"""`ModelSpec`: the architecture hyperparameters the model forward needs, whatever the file format.

Built from a Hugging Face `config.json` (`ModelSpec.from_hf_config`) or from a GGUF file's
metadata (`argosy_runtime.model_loader.gguf_checkpoint.spec_from_gguf`).
"""

from __future__ import annotations

import math
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
    # Mixture-of-Experts decoders: Llama-family attention, a sparse MoE block for the MLP.
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Phi-3 / Phi-3.5 / Phi-4 (mini, medium, 14B): Llama's block with q/k/v and gate/up stored
    # fused (`qkv_proj`, `gate_up_proj`), longrope scaling and (Phi-4-mini) partial rotary.
    "Phi3ForCausalLM": "phi3",
    # Gemma 2 and Gemma 3 text (models/gemma3.py's layer; model_loader/gemma3_config.py reads
    # the config): gemma-2-2b/9b/27b; gemma-3-1b is a Gemma3ForCausalLM; of the multimodal
    # 4b/12b/27b only the text is served.
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    # SmolLM3 (HuggingFaceTB/SmolLM3-3B): Llama with NoPE layers (no rotary in every 4th layer
    # by default: `nope_layers`). Granite 3.x dense (ibm-granite/granite-3.x-*): Llama with
    # four scalar multipliers (the `*_multiplier` / `logits_scaling` fields). Their MoE and
    # hybrid variants (granitemoe*, granitemoehybrid) are other architectures: refused.
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
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
                                  "qwen3": "qwen3", "mixtral": "mixtral",
                                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                                  "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                                  "gemma3": "gemma3", "smollm3": "smollm3",
                                  "granite": "granite"}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "mixtral",
                                            "qwen2_moe", "qwen3_moe", "phi3", "gemma2", "gemma3",
                                            "smollm3", "granite", "bert", "xlm_roberta")
# Gemma 2 and 3: four norms per layer scaling by 1 + weight, gelu-tanh, scaled embeddings
# (models/gemma3.py); Gemma 3 adds q/k norms and a local rotary table.
GEMMA_ARCHITECTURES: frozenset[str] = frozenset({"gemma2", "gemma3"})
# Architectures whose MLP is (in some or all layers) a sparse Mixture-of-Experts block
# (models/moe.py): Mixtral in every layer; Qwen2-MoE (+ a gated shared expert) and Qwen3-MoE
# in the layers `decoder_sparse_step` / `mlp_only_layers` choose.
MOE_ARCHITECTURES: frozenset[str] = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})
# transformers' config-class defaults (5.25) of the fields from_hf_config reads, where they
# differ from the generic fallbacks below: a config.json that omits a field means its class's
# default (Mixtral's and Phi-3's rms_norm_eps 1e-5, Mistral windows every layer at 4096,
# Qwen3's head_dim is 128, the Qwen families slide from layer 28 on), and configs written by
# hand omit some. (The expert counts and sizes stay required: a clear error rather than a
# guess.) Checked against the config classes in
# tests/runtime/model_loader/test_loader_config_defaults.py; Gemma's are in gemma3_config.py.
_HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131_072,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32_768,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32_768,
              "sliding_window": 4096, "max_window_layers": 28},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096},
    "mixtral": {"rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                "max_position_embeddings": 131_072},
    "qwen2_moe": {"num_key_value_heads": 16, "max_position_embeddings": 32_768,
                  "sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32_768,
                  "sliding_window": 4096},
    # SmolLM3Config: 4 KV heads, tied embeddings, Llama-3 token ids; a NoPE layer every 4th
    # (`no_rope_layer_interval`, read by _hf_nope_layers) unless `no_rope_layers` lists them.
    "smollm3": {"num_key_value_heads": 4, "max_position_embeddings": 32_768,
                "tie_word_embeddings": True, "bos_token_id": 128_000, "eos_token_id": 128_001},
    # GraniteConfig: every multiplier 1.0 (_hf_smollm3_granite), the attention scale included.
    "granite": {"bos_token_id": 1, "eos_token_id": 2},
}
# Architectures whose attention (in transformers) biases o_proj as well as q/k/v when
# config.json says `attention_bias: true`: refused then (our o_proj has no bias).
_O_PROJ_BIASED = frozenset({"llama", "qwen3", "qwen3_moe", "gemma2", "gemma3", "smollm3",
                            "granite"})
# The config classes' `default_theta` (the rope base when a config gives none): 10000 unless here.
_HF_DEFAULT_THETA: dict[str, float] = {"mixtral": 1_000_000.0, "smollm3": 2_000_000.0}
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
    `layer_sliding_windows` holds, per layer, the attention window of a sliding-window
    checkpoint (Mistral-7B v0.1: every layer; Qwen2/Qwen3 with `use_sliding_window`: layers
    from `max_window_layers` on, or as `layer_types` says), None for a full-attention layer;
    empty when no layer slides. A query at position p of a layer with window W sees the keys
    at positions k with p - W < k <= p (W keys, itself included), as transformers' mask does;
    `sliding_window(i)` reads it per layer.
    Mixture-of-Experts checkpoints (MOE_ARCHITECTURES) set `num_experts` (0 elsewhere) and
    `num_experts_per_tok` (top-k), `moe_intermediate_size` (each expert's; Mixtral: its
    intermediate_size), `norm_topk_prob` (renormalize the top-k routing weights to sum to 1:
    always for Mixtral), `shared_expert_intermediate_size` (Qwen2-MoE's always-on shared
    expert; 0: none) and `sparse_layers` (the layers with an MoE block; the others keep the
    dense MLP of `intermediate_size`).
    `partial_rotary_factor` (Phi-4-mini: 0.75) rotates only the first `rotary_dim` =
    int(head_dim * factor) values of each query and key head; the rest pass through.
    Gemma 2 and 3 set `hidden_act` "gelu_pytorch_tanh" (the MLP's gelu with the tanh
    approximation, instead of SiLU), `query_pre_attn_scalar` (attention scale
    query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5), `final_logit_softcapping`
    (logits -> cap * tanh(logits / cap); None: none) and `attn_logit_softcapping` (every
    layer's scaled attention scores s -> cap * tanh(s / cap) before the mask and softmax;
    Gemma 2: 50; None: none). Gemma 3 also sets `local_rope_theta` (the sliding-window layers'
    own unscaled rotary base; the full-attention layers use rope_theta and rope_scaling).
    SmolLM3 sets `nope_layers`: the layers whose attention applies no rotary embedding
    (NoPE); every other layer rotates q and k as Llama's. Granite sets the four multipliers
    of GraniteConfig (1.0 / None elsewhere): embeddings times `embedding_multiplier`, each
    attention and MLP output times `residual_multiplier` before its residual add, attention
    scale `attention_multiplier` (instead of head_dim ** -0.5), logits divided by
    `logits_scaling`.
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
    layer_sliding_windows: tuple[int | None, ...] = ()
    id2label: tuple[str, ...] = ()
    # What a one-label head's logit goes through as a score (LLM.score, /v1/score, /v1/rerank):
    # "sigmoid" (vLLM's default), "identity" or "tanh" (`_hf_score_activation`).
    score_activation: str = "sigmoid"
    # config.json `problem_type` of a classifier: how its logits become `probs`
    # (ClassificationOutput.from_logits); None: by the number of labels.
    problem_type: str | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    partial_rotary_factor: float = 1.0
    # Gemma 2 / 3 (None / "silu" elsewhere): see the class docstring.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # SmolLM3 (() elsewhere) and Granite (1.0 / None elsewhere): see the class docstring.
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # A classifier whose head is rows of the causal LM's lm_head (vLLM's classifier_from_token
    # and method: Qwen3-Reranker's "no"/"yes"; model_loader/lm_head_classifier.py), and the
    # token ids they resolve to. use_sep_token: a cross-encoder joins a pair with the
    # tokenizer's pair template (true) or as text_1 + text_2 (false; an LLM reranker's default).
    classifier_from_token: tuple[str, ...] = ()
    classifier_method: str | None = None
    classifier_from_tied_embeddings: bool = False
    classifier_token_ids: tuple[int, ...] = ()
    use_sep_token: bool = True
    # Encoder-only models (bert, xlm_roberta: model_loader/encoder_config.py, models/bert.py):
    # token-type rows (0: none), the first position id (XLM-R: pad_token_id + 1), and the
    # embedding pooling its sentence-transformers config names (None: the model's default)
    # and whether that normalizes.
    type_vocab_size: int = 0
    position_offset: int = 0
    pooling_type: str | None = None
    pooling_normalize: bool = True

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
        if self.layer_sliding_windows and len(self.layer_sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"layer_sliding_windows needs one entry per layer "
                             f"({self.num_hidden_layers}), got {len(self.layer_sliding_windows)}")
        for window in self.layer_sliding_windows:
            if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                       or window <= 0):
                raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        if not self.has_lm_head and self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings needs an lm_head to tie; has_lm_head is False")
        if any(not 1 <= d <= self.hidden_size for d in self.matryoshka_dimensions or ()):
            raise ValueError(f"matryoshka_dimensions must lie in 1..hidden_size "
                             f"({self.hidden_size}), got {list(self.matryoshka_dimensions)}")
        if self.classifier_from_token and not (self.id2label and self.classifier_method):
            raise ValueError("classifier_from_token needs a classification head and a method")
        if self.id2label and self.has_lm_head:
            raise ValueError("id2label (a classification head) replaces the lm_head; "
                             "has_lm_head must be False")
        if self.partial_rotary_factor != 1.0 and (
                not 0.0 < self.partial_rotary_factor < 1.0 or self.rotary_dim < 2
                or self.rotary_dim % 2):
            raise ValueError(f"partial_rotary_factor must give an even rotary_dim in 2..head_dim, "
                             f"got {self.partial_rotary_factor!r} (head_dim {self.head_dim})")
        self._check_moe()
        self._check_gemma()
        self._check_smollm3_granite()

    def _check_smollm3_granite(self) -> None:
        if self.nope_layers and (self.architecture != "smollm3" or any(
                not 0 <= i < self.num_hidden_layers for i in self.nope_layers)
                or list(self.nope_layers) != sorted(set(self.nope_layers))):
            raise ValueError(f"nope_layers must be distinct ascending layer indices of a smollm3 "
                             f"model, got {list(self.nope_layers)} for {self.architecture!r}")
        multipliers = {"embedding_multiplier": self.embedding_multiplier,
                       "residual_multiplier": self.residual_multiplier,
                       "attention_multiplier": self.attention_multiplier,
                       "logits_scaling": self.logits_scaling}
        if self.architecture != "granite" and any(
                value != (None if name == "attention_multiplier" else 1.0)
                for name, value in multipliers.items()):
            raise ValueError(f"embedding_multiplier / residual_multiplier / attention_multiplier "
                             f"/ logits_scaling are Granite fields, not {self.architecture!r}'s")
        for name, value in multipliers.items():
            # A zero logits_scaling divides by zero; the others have no use at 0 or below.
            if value is not None and not (isinstance(value, (int, float)) and value > 0
                                          and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    def _check_gemma(self) -> None:
        if self.is_encoder:  # encoder_config.py checks its activations
            return
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_pytorch_tanh, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "local_rope_theta", "final_logit_softcapping",
                     "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        if not self.is_gemma and (self.hidden_act != "silu" or self.query_pre_attn_scalar
                                  or self.attn_logit_softcapping):
            raise ValueError(f"hidden_act / query_pre_attn_scalar / attn_logit_softcapping are "
                             f"Gemma fields, not {self.architecture!r}'s")
        if self.architecture != "gemma3" and self.local_rope_theta:
            raise ValueError(f"local_rope_theta is a Gemma 3 field, not {self.architecture!r}'s")

    @property
    def rotary_dim(self) -> int:
        """How many leading values of each query/key head the rotary embedding turns
        (head_dim unless `partial_rotary_factor` < 1; transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_moe(self) -> None:
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts or self.sparse_layers:
                raise ValueError(f"num_experts / sparse_layers are for Mixture-of-Experts "
                                 f"architectures ({', '.join(sorted(MOE_ARCHITECTURES))}), "
                                 f"not {self.architecture!r}")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.architecture}: {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{self.architecture}: num_experts_per_tok "
                             f"({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        if any(not 0 <= i < self.num_hidden_layers for i in self.sparse_layers) or (
                list(self.sparse_layers) != sorted(set(self.sparse_layers))):
            raise ValueError(f"sparse_layers must be distinct ascending layer indices below "
                             f"num_hidden_layers ({self.num_hidden_layers}), "
                             f"got {list(self.sparse_layers)}")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"shared_expert_intermediate_size must be a non-negative integer, "
                             f"got {shared!r}")
        if self.architecture == "qwen2_moe" and shared == 0:
            raise ValueError("qwen2_moe: shared_expert_intermediate_size must be positive "
                             "(Qwen2-MoE has a shared expert)")
        if self.architecture != "qwen2_moe" and shared:
            raise ValueError(f"{self.architecture} has no shared expert; "
                             f"shared_expert_intermediate_size must be 0, got {shared}")

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
    def is_encoder(self) -> bool:
        """An encoder-only model (BERT, XLM-RoBERTa): bidirectional attention over each whole
        prompt in one step, pooling only (models/bert.py)."""
        return self.architecture in ("bert", "xlm_roberta")

    @property
    def takes_token_types(self) -> bool:
        """An encoder with a second token type (BERT; XLM-R has one): it reads a pair's token
        types (PoolingParams.token_type_start), as transformers' BERT tokenizer returns them."""
        return self.is_encoder and self.type_vocab_size > 1

    @property
    def num_labels(self) -> int:
        """Rows of the classification head (0: not a sequence-classification checkpoint)."""
        return len(self.id2label)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Gemma 3 normalize each query and key head (RMSNorm over head_dim, its
        own weight per layer) before the rotary embedding; the other architectures do not."""
        return self.architecture in ("qwen3", "qwen3_moe", "gemma3")

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 or 3: models/gemma3.py's layer (four norms), the switches below."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def gemma_norms(self) -> bool:
        """Gemma's RMSNorm: normalized x times (1 + weight), multiplied in float32 and rounded
        once (Llama's rounds x first). The model stores 1 + weight (folded at load)."""
        return self.is_gemma

    @property
    def embedding_scale(self) -> float | None:
        """Gemma multiplies the embeddings by sqrt(hidden_size) (rounded to the model dtype
        first), Granite by embedding_multiplier; None: no scaling."""
        if self.is_gemma:
            return self.hidden_size ** 0.5
        return None if self.embedding_multiplier == 1.0 else self.embedding_multiplier

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: attention_multiplier (Granite), query_pre_attn_scalar **
        -0.5 (Gemma), else head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (all but SmolLM3's NoPE layers)."""
        return layer not in self.nope_layers

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the local table (local_rope_theta, unscaled):
        Gemma 3's sliding-window layers."""
        return self.local_rope_theta is not None and self.sliding_window(layer) is not None

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a sparse Mixture-of-Experts block."""
        return bool(self.sparse_layers)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has an MoE block (else the dense MLP)."""
        return layer_idx in self.sparse_layers

    @property
    def router_weights_in_float32(self) -> bool:
        """Mixtral scales each expert's output by its float32 routing weight; Qwen MoE casts
        the weights to the model dtype first (transformers' routers; equal in float32)."""
        return self.architecture == "mixtral"

    def sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (keys p - W < k <= p), None for full attention."""
        return self.layer_sliding_windows[layer] if self.layer_sliding_windows else None

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
        from argosy_runtime.model_loader.encoder_config import (
            encoder_architecture,
            encoder_spec_fields,
        )

        # Checked first: both lookups below hash these values.
        names = config.get("architectures") or []
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"config.json: architectures must be a list of class names, "
                             f"got {names!r}")
        if not isinstance(config.get("model_type") or "", str):
            raise ValueError(f"config.json: model_type must be a string, "
                             f"got {config['model_type']!r}")
        encoder = encoder_architecture(config)
        if encoder is not None:  # BERT / XLM-RoBERTa: their own config fields
            return cls(**encoder_spec_fields(config, *encoder), checkpoint_dtype=checkpoint_dtype,
                       id2label=_hf_labels(config) if encoder[1] else (),
                       score_activation=_hf_score_activation(config),
                       problem_type=_hf_problem_type(config))
        architecture, has_lm_head, is_classifier = _hf_architecture(config)
        gemma: dict[str, Any] = {}
        if architecture in GEMMA_ARCHITECTURES:  # Hub defaults; Gemma 3: text_config, 2 rotaries
            from argosy_runtime.model_loader.gemma3_config import gemma_text_config

            config, gemma = gemma_text_config(config, architecture)
        else:
            config = {**_HF_CONFIG_DEFAULTS.get(architecture, {}), **config}
        hidden_size = config_int(config, "hidden_size")
        num_heads = config_int(config, "num_attention_heads")
        num_kv_heads = config_int(config, "num_key_value_heads", num_heads) or num_heads
        head_dim = config_int(config, "head_dim", None)
        if head_dim is None:
            if num_heads <= 0:  # before dividing by it
                raise ValueError(f"num_attention_heads must be a positive integer, got {num_heads}")
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"config.json: hidden_size ({hidden_size}) is not divisible by "
                    f"num_attention_heads ({num_heads}) and head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        if config.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        if architecture in _O_PROJ_BIASED and config.get("attention_bias"):
            # Their attention (transformers') then has an o_proj bias too, which ours has not:
            # the checkpoint's o_proj.bias would fail the load naming only the tensor.
            raise ValueError(f"config.json: attention_bias=true is not supported for "
                             f"{architecture} (it adds a bias to o_proj as well)")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (silu only)")
        rope_theta, rope_scaling = _hf_rope(config, _HF_DEFAULT_THETA.get(architecture, 10000.0))
        partial_rotary_factor = 1.0
        if architecture == "phi3":
            rope_scaling, partial_rotary_factor = _phi3_rope(config, rope_scaling, head_dim)
        # Qwen2's config has no attention_bias field: its q/k/v projections always have a bias.
        # Qwen2-MoE's too (transformers 5 writes qkv_bias, default true).
        if architecture == "qwen2":
            attention_bias = True
        elif architecture == "qwen2_moe":
            attention_bias = bool(config.get("qkv_bias", True))
        elif architecture in ("mistral", "mixtral", "phi3"):
            attention_bias = False  # their attention has no bias, whatever the config says
        else:
            attention_bias = bool(config.get("attention_bias", False))
        eos_ids = _as_id_list(config.get("eos_token_id"), "config.json: eos_token_id")
        if generation_config is not None:
            eos_ids += _as_id_list(generation_config.get("eos_token_id"),
                                   "generation_config.json: eos_token_id")
        bos = config_int(config, "bos_token_id", None)
        if bos is None and generation_config is not None:
            bos = config_int(generation_config, "bos_token_id", None, "generation_config.json")
        return cls(
            architecture=architecture,
            vocab_size=config_int(config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=config_int(config, "intermediate_size"),
            num_hidden_layers=config_int(config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config_int(config, "max_position_embeddings", 2048),
            # Headless configs may still say tie_word_embeddings (a transformers default):
            # without a head there is nothing to tie.
            tie_word_embeddings=has_lm_head and bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            checkpoint_dtype=checkpoint_dtype,
            has_lm_head=has_lm_head,
            layer_sliding_windows=_hf_sliding_windows(config, architecture),
            id2label=_hf_labels(config) if is_classifier else (),
            score_activation=_hf_score_activation(config),
            problem_type=_hf_problem_type(config),
            matryoshka_dimensions=_hf_matryoshka(config),
            **_hf_moe(config, architecture),
            partial_rotary_factor=partial_rotary_factor,
            **gemma,
            **_hf_smollm3_granite(config, architecture),
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


def _hf_moe(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The Mixture-of-Experts fields of ModelSpec from config.json ({} for a dense model).

    Mixtral: `num_local_experts` experts of `intermediate_size` in every layer, top-k weights
    renormalized. Qwen2/Qwen3-MoE: `num_experts` (transformers 5 may write
    `num_local_experts`) of `moe_intermediate_size`; layer i is sparse unless it is in
    `mlp_only_layers`, and only if (i + 1) % `decoder_sparse_step` == 0 (transformers'
    Qwen*MoeDecoderLayer); `norm_topk_prob` as given (default false).
    """
    if architecture not in MOE_ARCHITECTURES:
        return {}
    num_layers = config_int(config, "num_hidden_layers")
    keys = ("num_local_experts", "num_experts") if architecture == "mixtral" else (
        "num_experts", "num_local_experts")
    key = next((k for k in keys if config.get(k)), None)
    if key is None:
        raise ValueError(f"config.json: a {architecture} model needs num_experts "
                         "(num_local_experts)")
    num_experts = config_int(config, key)
    top_k = config_int(config, "num_experts_per_tok")
    if architecture == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=config_int(config, "intermediate_size"),
                    norm_topk_prob=True, sparse_layers=tuple(range(num_layers)))
    step = config_int(config, "decoder_sparse_step", 1) or 1
    if step <= 0:
        raise ValueError(f"config.json: decoder_sparse_step must be positive, got {step}")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, "
                         f"got {mlp_only!r}")
    sparse = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
    shared = config_int(config, "shared_expert_intermediate_size", 0)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=config_int(config, "moe_intermediate_size"),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=shared if architecture == "qwen2_moe" else 0,
                sparse_layers=sparse)


def _hf_smollm3_granite(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """SmolLM3's nope_layers and Granite's multipliers as ModelSpec fields ({} otherwise),
    absent ones at GraniteConfig's defaults (1.0, the attention scale included)."""
    if architecture == "smollm3":
        return {"nope_layers": _hf_nope_layers(config)}
    if architecture == "granite":
        return {name: config_float(config, name, 1.0) for name in (
            "embedding_multiplier", "residual_multiplier", "attention_multiplier",
            "logits_scaling")}
    return {}


def _hf_nope_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's NoPE layers as SmolLM3Config reads them: `no_rope_layers[i]` 1 = layer i
    rotates, 0 = it does not (a list at least num_hidden_layers long); without that list,
    every `no_rope_layer_interval`-th layer (default 4: layers 3, 7, 11, ...) is NoPE."""
    num_layers = config_int(config, "num_hidden_layers")
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config_int(config, "no_rope_layer_interval", 4)
        if interval <= 0:
            raise ValueError(f"config.json: no_rope_layer_interval must be positive, got {interval}")
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if (not isinstance(flags, list) or len(flags) < num_layers
            or not all(isinstance(f, int) and f in (0, 1) for f in flags)):
        raise ValueError(f"config.json: no_rope_layers must be a list of 0/1 flags (1: rotary) "
                         f"for each of the {num_layers} layers, got {flags!r}")
    return tuple(i for i in range(num_layers) if not flags[i])


def _smollm3_sliding_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """SmolLM3's windows as its mask picks them: layer i slides over `sliding_window` keys
    where `layer_types[i]` is "sliding_attention"; without layer_types, the NoPE layers do
    when `use_sliding_window` is true and a window is set (SmolLM3Config's default). A
    layer_types that marks sliding layers without both is refused: transformers' attention
    implementations disagree on such a config (the eager/sdpa mask slides, flash attention
    does not, or there is no window to slide over)."""
    num_layers = config_int(config, "num_hidden_layers")
    window = config_int(config, "sliding_window", None)
    enabled = bool(config.get("use_sliding_window", False)) and window is not None
    layer_types = config.get("layer_types")
    if layer_types is None:
        nope = _hf_nope_layers(config)
        sliding = [enabled and i in nope for i in range(num_layers)]
    else:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers or not all(
                t in ("full_attention", "sliding_attention") for t in layer_types):
            raise ValueError(f"config.json: layer_types must list full_attention or "
                             f"sliding_attention for each of the {num_layers} layers, "
                             f"got {layer_types!r}")
        sliding = [t == "sliding_attention" for t in layer_types]
        if any(sliding) and not enabled:
            raise ValueError("config.json: layer_types marks sliding_attention layers but "
                             "use_sliding_window is not true or sliding_window is null "
                             "(transformers' attention implementations disagree on them)")
    return tuple(window if s else None for s in sliding) if any(sliding) else ()


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
    num_labels = config_int(config, "num_labels", 2) or 2
    if num_labels < 1:
        raise ValueError(f"config.json: num_labels must be positive, got {num_labels}")
    return tuple(f"LABEL_{i}" for i in range(num_labels))


_SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                      "torch.nn.modules.linear.Identity": "identity",
                      "torch.nn.modules.activation.Tanh": "tanh"}


def _hf_score_activation(config: dict[str, Any]) -> str:
    """The activation a cross-encoder's score takes, as sentence-transformers' CrossEncoder
    and vLLM read it: `sentence_transformers.activation_fn`, else the older
    `sbert_ce_default_activation_function` (ms-marco-MiniLM-L-6-v2: Identity, the raw logit),
    else the sigmoid. Another activation is refused: a score through the wrong one would be
    silently another number."""
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    if name is None:
        name = config.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    if name not in _SCORE_ACTIVATIONS:
        raise ValueError(f"config.json: cross-encoder activation {name!r} is not supported "
                         f"(one of {', '.join(_SCORE_ACTIVATIONS)})")
    return _SCORE_ACTIVATIONS[name]


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def _hf_problem_type(config: dict[str, Any]) -> str | None:
    """transformers' `problem_type` (what the head was trained for), or None."""
    problem = config.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise ValueError(f"config.json: problem_type must be one of {', '.join(PROBLEM_TYPES)} "
                         f"or null, got {problem!r}")
    return problem


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


def _hf_sliding_windows(config: dict[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's attention window, as transformers 5 builds the model; () if none slides.

    Mistral, Mixtral and Phi-3 window every layer when `sliding_window` is set (Mistral-7B v0.1:
    4096; later ones: null) and ignore `layer_types`. The Qwen families window only with
    `use_sliding_window` (their configs drop the window otherwise): Qwen3-MoE every layer;
    Qwen2, Qwen3 and Qwen2-MoE the layers `layer_types` marks "sliding_attention", by default
    those from `max_window_layers` on (Qwen2-MoE: the even layers below it). Gemma 3: the
    layers `layer_types` marks (gemma3_config.py fills it in); Gemma 2 likewise. SmolLM3:
    `_smollm3_sliding_windows`. Llama and Granite (GraniteConfig has no window): none.
    """
    if architecture == "smollm3":
        return _smollm3_sliding_windows(config)
    window = config.get("sliding_window")
    num_layers = int(config.get("num_hidden_layers", 0))
    if not window or architecture in ("llama", "granite"):
        return ()
    window = config_int(config, "sliding_window")  # a list or a string is not a window
    if architecture == "phi3" and int(window) >= int(config.get("max_position_embeddings", 0) or 0):
        return ()  # Phi-3-128k's 262144: never reached, so plain causal attention is the same
    if architecture in ("mistral", "mixtral", "phi3"):
        windows: list[int | None] = [int(window)] * num_layers
    elif architecture in GEMMA_ARCHITECTURES:  # layer_types, filled in by gemma3_config.py
        windows = [int(window) if t == "sliding_attention" else None
                   for t in config["layer_types"]]
    elif not config.get("use_sliding_window"):
        return ()
    elif architecture == "qwen3_moe":
        windows = [int(window)] * num_layers
    else:
        layer_types = config.get("layer_types")
        if not isinstance(layer_types, list):
            bound = int(config.get("max_window_layers", num_layers))
            slides = ((lambda i: i % 2 == 0 and i < bound) if architecture == "qwen2_moe"
                      else (lambda i: i >= bound))
            layer_types = ["sliding_attention" if slides(i) else "full_attention"
                           for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        windows = [int(window) if t == "sliding_attention" else None for t in layer_types]
    return tuple(windows) if any(w is not None for w in windows) else ()


def _hf_rope(config: dict[str, Any], default_theta: float = 10000.0
             ) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout, as transformers 5's
    convert_rope_params_to_dict / standardize_rope_params read them.

    transformers 4.x writes `rope_theta` and `rope_scaling`; 5.x writes one `rope_parameters`
    dict holding `rope_theta`, `rope_type` and the scaling fields. A non-empty `rope_scaling`
    wins over `rope_parameters` (a 5.x config a user added rope_scaling to, as model cards
    tell them to: ignoring it would serve the unscaled rotary), its base then read from the
    top-level `rope_theta`, else the model's default (`default_theta`). A llama3 / yarn /
    longrope dict without `original_max_position_embeddings` takes max_position_embeddings;
    a yarn dict's null `factor` is max_position_embeddings / original (transformers').
    """
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):  # else silently theta 10000
        raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
    rope_scaling = config.get("rope_scaling")
    if rope_scaling and not isinstance(rope_scaling, dict):
        raise ValueError(f"config.json: rope_scaling must be an object, got {rope_scaling!r}")
    scaling = dict(rope_scaling or params or {})
    theta = scaling.pop("rope_theta", config.get("rope_theta", default_theta))
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type") in ("llama3", "yarn", "longrope"):  # (Phi-3: _phi3_rope)
        scaling.setdefault("original_max_position_embeddings",
                           config_int(config, "max_position_embeddings", 2048))
    if scaling.get("rope_type") == "yarn" and "factor" in scaling and scaling["factor"] is None:
        # transformers' reading of a null yarn factor (DeepSeek-V3 style configs); a missing
        # one is refused below, as transformers' KeyError.
        scaling["factor"] = (config_int(config, "max_position_embeddings", 2048)
                             / _as_number(scaling["original_max_position_embeddings"],
                                          "config.json: original_max_position_embeddings"))
    theta = _as_number(theta, "config.json: rope_theta")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return theta, None
    # The fields models/rotary.py reads for these types: a KeyError there otherwise.
    for key in _ROPE_SCALING_FIELDS.get(kind, ()):
        if key not in scaling:
            raise ValueError(f"config.json: {kind} rope scaling needs {key!r} "
                             f"(has {', '.join(sorted(scaling))})")
        # A factor of 0 divides the frequencies by 0: NaN rotations, garbage output.
        if not _as_number(scaling[key], f"config.json: rope scaling {key}") > 0:
            raise ValueError(f"config.json: rope scaling {key} must be positive, "
                             f"got {scaling[key]!r}")
    for key in _ROPE_SCALING_NUMBERS.get(kind, ()):  # optional, but a string fails late
        if scaling.get(key) is not None:
            _as_number(scaling[key], f"config.json: rope scaling {key}")
    return theta, scaling


def _phi3_rope(config: dict[str, Any], scaling: dict | None, head_dim: int
               ) -> tuple[dict | None, float]:
    """Phi-3's rope scaling as transformers' Phi3Config reads it, and partial_rotary_factor.

    Old configs say `type: "su"` (or "yarn") for longrope. A longrope dict gets
    `original_max_position_embeddings` from the top level (Phi3Config prefers it over the one
    inside the dict) and its `attention_factor` (the cos/sin scale) computed as transformers
    does: sqrt(1 + ln(factor) / ln(original)) with factor = max_position_embeddings /
    original unless given, 1.0 when factor <= 1. Which factor list applies is decided by
    models/rotary.py from the served context length (vLLM's rule).
    `partial_rotary_factor` (Phi-4-mini: 0.75) may sit at the top level or in rope_parameters.
    """
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    factor_key = "partial_rotary_factor"
    partial = float((scaling or {}).get(factor_key, params.get(factor_key,
                                                               config.get(factor_key, 1.0))))
    if scaling is None:
        return None, partial
    scaling = {k: v for k, v in scaling.items() if k not in (factor_key, "type")}
    if scaling["rope_type"] in ("su", "yarn", "longrope"):
        scaling["rope_type"] = "longrope"
    else:
        raise ValueError(f"config.json: Phi-3 rope scaling type {scaling['rope_type']!r} is not "
                         "supported (default or longrope)")
    original = config.get("original_max_position_embeddings",
                          scaling.get("original_max_position_embeddings"))
    if original is None:
        original = config_int(config, "max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    rotary_half = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list) or len(values) != rotary_half or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"config.json: longrope {key} must be a list of {rotary_half} numbers "
                             f"(rotary_dim / 2), got {values!r}")
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor")
        if factor is None:
            factor = int(config.get("max_position_embeddings", original)) / int(original)
        scaling["attention_factor"] = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original))))
    return scaling, partial


_ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_ROPE_SCALING_NUMBERS = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
_REQUIRED = object()


def config_int(config: dict[str, Any], key: str, default: Any = _REQUIRED,
               file: str = "config.json") -> Any:
    """`config[key]` as an int, `default` when it is absent or null (unless required):
    ValueError naming the field for anything else than an integer (a string, a list, 64.5,
    true), instead of a TypeError from int() or a value silently truncated."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            if key in config:
                raise ValueError(f"{file}: {key} must be an integer, got null")
            raise ValueError(f"{file}: missing required field {key!r}")
        return default
    return _as_int(value, f"{file}: {key}")


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return value


def config_float(config: dict[str, Any], key: str, default: float | None) -> float | None:
    """`config[key]` as a float (`default` when absent or null), ValueError naming the field
    for anything else than a number."""
    value = config.get(key)
    return default if value is None else _as_number(value, f"config.json: {key}")


def _as_number(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


def _as_id_list(value: Any, what: str) -> list[int]:
    """A token id or a list of them (eos_token_id), ValueError naming `what` otherwise."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{what} must be a token id or a list of token ids, got {value!r}")
    return ids
