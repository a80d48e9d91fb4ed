"""Encoder-only models: BERT and XLM-RoBERTa, for embeddings and cross-encoder scores.

The engine runs them like a decoder's prefill (one flattened batch of every scheduled token,
`forward(input_ids, positions, ctx) -> [num_tokens, hidden]`), but attention is bidirectional
within each sequence: every token sees every token of its own prompt, so each prompt runs
whole in one step (the engine turns chunked prefill and prefix caching off for them) and no
KV cache is read or written. The step's sequences are the metadata's decode rows (one token
each) then its multi-token sequences (`prefill_query_lens`); attention runs as one SDPA call
over them padded to the longest, padding masked out of the keys.

Layers as transformers' BertLayer (post-norm): x = LN(x + attn(x)); x = LN(x + mlp(x)), with
biased q/k/v/o, an exact-erf GELU MLP (or the config's hidden_act) and LayerNorm with a bias.
Embeddings: word + absolute position + token type, then LayerNorm. XLM-R numbers positions
as transformers' create_position_ids_from_input_ids does: pad_token_id + 1 for the first
token, counting only tokens that are not the pad id; a pad token in the prompt gets
pad_token_id itself. Token types are 0, except from each request's
`PoolingParams.token_type_start` on (the runner passes them as `ctx.token_type_starts`): a
BERT cross-encoder's second text, where the tokenizer's pair encoding puts it
(`tokenizer(text_1, text_2)["token_type_ids"]`, `scoring.cross_encoder_prompt`). They cannot
be read off the ids: a text may itself contain the [SEP] token.

A sequence classifier (`spec.num_labels`) has `head`: dense + tanh on the first token ([CLS]
/ <s>) then `out_proj` (BERT's pooler + classifier, XLM-R's classifier.dense + out_proj).
Weight names are the checkpoints' own, without `bert.` / `roberta.`
(model_loader/encoder_config.py maps them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from argosy_runtime.attention import AttentionMetadata
    from argosy_runtime.model_loader import ModelSpec

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def check_encoder_options(args: Any) -> None:
    """ValueError for engine options an encoder-only model cannot take."""
    refused = {
        "tensor_parallel_size > 1": args.tensor_parallel_size > 1,
        "quantization": args.quantization is not None,
        "speculative": args.speculative is not None,
        "kv_cache_dtype int8": args.kv_cache_dtype != "auto",
        "batch_invariant": bool(args.batch_invariant),
        "LoRA adapters": bool(args.lora_modules) or bool(args.lora_modules_file),
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"model: an encoder-only model (BERT, XLM-RoBERTa) serves embeddings "
                         f"and scores with bidirectional attention; it does not support "
                         f"{', '.join(named)}")


class _Linear(nn.Linear):
    """nn.Linear without the random init (every weight comes from the checkpoint)."""

    def reset_parameters(self) -> None:
        pass


class _LayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        pass


class EncoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, inter = spec.hidden_size, spec.intermediate_size
        eps = spec.rms_norm_eps
        self.num_heads, self.head_dim = spec.num_attention_heads, spec.head_dim
        # transformers' module tree, so its weight names load as they are.
        self.attention = nn.ModuleDict({
            "self": nn.ModuleDict({n: _Linear(h, h) for n in ("query", "key", "value")}),
            "output": nn.ModuleDict({"dense": _Linear(h, h), "LayerNorm": _LayerNorm(h, eps)}),
        })
        self.intermediate = nn.ModuleDict({"dense": _Linear(h, inter)})
        self.output = nn.ModuleDict({"dense": _Linear(inter, h), "LayerNorm": _LayerNorm(h, eps)})
        self.act = _ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        qkv = self.attention["self"]
        shape = (-1, self.num_heads, self.head_dim)
        q = qkv["query"](x).view(shape)  # [tokens, heads, head_dim]
        k = qkv["key"](x).view(shape)
        v = qkv["value"](x).view(shape)
        a = layout.attend(q, k, v).reshape(x.shape)
        out = self.attention["output"]
        x = out["LayerNorm"](out["dense"](a) + x)
        m = self.output["dense"](self.act(self.intermediate["dense"](x)))
        return self.output["LayerNorm"](m + x)


class SequenceLayout:
    """Where each sequence's tokens sit in the flattened step, and bidirectional attention
    over each sequence (built once per step, shared by the layers)."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.lens = lens
        self.max_len = max(lens)
        self.num_tokens = sum(lens)
        self.padded = len(lens) > 1 and min(lens) != self.max_len
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        if self.padded:  # each token's row in the [num_seqs * max_len] padded layout
            lens_t = torch.tensor(lens, device=device)
            starts = torch.arange(len(lens), device=device) * self.max_len
            offsets = torch.arange(self.num_tokens, device=device) - torch.repeat_interleave(
                torch.cumsum(lens_t, 0) - lens_t, lens_t)
            self.index = torch.repeat_interleave(starts, lens_t) + offsets
            # [num_seqs, 1, 1, max_len]: True for a sequence's real keys
            self.mask = (torch.arange(self.max_len, device=device)[None, :]
                         < lens_t[:, None])[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] q, k, v -> attention output of the same shape."""
        num_seqs = len(self.lens)
        if not self.padded:  # one sequence, or all the same length: no padding
            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(num_seqs, self.max_len, *t.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(split(q), split(k), split(v))
            return out.transpose(1, 2).reshape(q.shape)

        def pad(t: torch.Tensor) -> torch.Tensor:
            buf = t.new_zeros(num_seqs * self.max_len, *t.shape[1:])
            buf[self.index] = t
            return buf.view(num_seqs, self.max_len, *t.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=self.mask)
        return out.transpose(1, 2).reshape(-1, *q.shape[1:])[self.index]


class ClassifierHead(nn.Module):
    """dense + tanh on the first token's state, then out_proj to the labels."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.dense = _Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = _Linear(spec.hidden_size, spec.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertModel(nn.Module):
    """BERT / XLM-RoBERTa encoder (+ classifier head) with the engine's model interface."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        with torch.device("meta"):
            self.embeddings = nn.Module()
            self.embeddings.word_embeddings = nn.Embedding(spec.vocab_size, h,
                                                           _weight=torch.empty(spec.vocab_size, h))
            num_positions = spec.max_position_embeddings + spec.position_offset
            self.embeddings.position_embeddings = nn.Embedding(
                num_positions, h, _weight=torch.empty(num_positions, h))
            self.embeddings.token_type_embeddings = (
                nn.Embedding(spec.type_vocab_size, h,
                             _weight=torch.empty(spec.type_vocab_size, h))
                if spec.type_vocab_size else None)
            self.embeddings.LayerNorm = _LayerNorm(h, spec.rms_norm_eps)
            self.encoder = nn.Module()
            self.encoder.layer = nn.ModuleList(EncoderLayer(spec)
                                               for _ in range(spec.num_hidden_layers))
            self.head = ClassifierHead(spec) if spec.num_labels else None
        self.to(dtype)
        self.to_empty(device=device)
        self.dtype = dtype
        # The engine's model interface (models/llama.py's LlamaForCausalLM): no rotary, no
        # language-model head, no fused kernels, decodes never batched apart.
        self.rotary = None
        self.lm_head = None
        self.score = self.head  # the runner sends classify rows to compute_class_logits
        self.cpu_decode = None
        self.tensor_parallel = None
        self.decode_rows_up_to = 1
        self.ops = "torch"
        self.uses_kv_cache = False

    def use_device_kernels(self) -> None:
        """Nothing to switch: the encoder runs torch ops (SDPA picks its kernel)."""

    def _layout(self, meta: AttentionMetadata, device: torch.device) -> SequenceLayout:
        """The step's sequences: each must be a whole prompt (positions from 0)."""
        whole = all(q == s for q, s in zip(meta.prefill_query_lens, meta.prefill_seq_lens,
                                           strict=True))
        if meta.num_decodes and whole:
            whole = bool((meta.decode_context_lens == 1).all())
        if not whole:
            raise RuntimeError("an encoder-only model must see each prompt whole in one step "
                               "(no chunked prefill, no prefix cache)")
        return SequenceLayout([1] * meta.num_decodes + list(meta.prefill_query_lens), device)

    @staticmethod
    def _token_types(positions: torch.Tensor, layout: SequenceLayout,
                     starts: list[int | None] | None) -> torch.Tensor:
        """[num_tokens] token type ids: 1 from each sequence's `starts` entry on, else 0.
        `positions` are offsets within each sequence (every prompt runs whole)."""
        if not starts or all(s is None for s in starts):
            return torch.zeros_like(positions)
        never = layout.max_len  # no position reaches it: all type 0
        first_one = torch.tensor([never if s is None else s for s in starts],
                                 device=positions.device)
        lens = torch.tensor(layout.lens, device=positions.device)
        return (positions >= torch.repeat_interleave(first_one, lens)).long()

    def _position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the position table: BERT's are the positions; XLM-R's (offset pad + 1)
        count only the tokens that are not the pad id, and a pad token gets the pad id, as
        transformers' create_position_ids_from_input_ids numbers them."""
        if not self.spec.position_offset:
            return positions
        pad = self.spec.position_offset - 1
        real = (input_ids != pad).long()  # [num_tokens]
        counted = torch.cumsum(real, 0)
        # Each token's sequence starts `positions` rows earlier: count within the sequence.
        first = torch.arange(len(positions), device=positions.device) - positions
        counted = counted - (counted - real)[first]
        return counted * real + pad

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any,
                num_layers: int | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] (after the last layer's LayerNorm)."""
        layout = self._layout(ctx.meta, input_ids.device)
        emb = self.embeddings
        h = emb.word_embeddings(input_ids) + emb.position_embeddings(
            self._position_ids(input_ids, positions))
        if emb.token_type_embeddings is not None:
            types = self._token_types(positions, layout, getattr(ctx, "token_type_starts", None))
            h = h + emb.token_type_embeddings(types)
        h = emb.LayerNorm(h)
        for layer in self.encoder.layer[:num_layers]:
            h = layer(h, layout)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"this {self.spec.architecture} model is an encoder: it serves "
                           "embeddings and scores only, not generation")

    def compute_class_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, num_labels] float32 logits of the classifier head, for the first-token
        ([CLS] / <s>) hidden states [n, hidden]."""
        if self.head is None:
            raise RuntimeError(f"this {self.spec.architecture} model has no classification head")
        return self.head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors (encoder_config.py names) in; ValueError for one the
        model does not have or of the wrong shape."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                what = "an embedding" if self.head is None else "a sequence-classification"
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {what} "
                                 f"{self.spec.architecture} model")
            rows = params[name].shape[0]
            if name == "embeddings.position_embeddings.weight" and tensor.shape[0] > rows:
                # A context cut to sentence_bert_config.json's max_seq_length
                # (encoder_config.resolve_encoder_spec): the rows past it are never read.
                tensor = tensor[:rows]
            if params[name].shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded

    def check_all_loaded(self, loaded: set[str]) -> None:
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
