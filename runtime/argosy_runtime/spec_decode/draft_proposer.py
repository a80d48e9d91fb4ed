"""Draft-model proposer: a small model guesses k tokens autoregressively, the target checks them.

Two kinds of draft:

- **self-draft** (`model` unset): the target's first `draft_layers` layers (default a quarter)
  plus its final norm and head. Those layers have the same weights (a request's LoRA adapter
  included) and see the same inputs as in the target, so their K/V *are* the target's: the
  draft reads and writes the target's own paged cache for layers < draft_layers and needs no
  cache or catch-up of its own. The slots it writes from the last token on are rewritten by
  the target's verification pass of the same step (every layer writes all new K/V before
  attention reads), so they never leak into results; their blocks go back to the pool once
  the draft has proposed, and the scheduler grants draft slots as it does without a draft.
- **separate draft** (`model` = a path with the same vocabulary, or `quantization` = "int4"/
  "int8" for a quantized copy of the target): K/V of its own, on blocks of its own
  (spec_decode/draft_cache.py: its own manager and layout, as many pages as the target's), so
  it runs beside any target layout. It is brought up to date lazily: before proposing, the
  draft runs over every token of the request it has not seen (the whole prompt the first time,
  then usually one or two tokens per step), so requests that pause speculating (adaptive k)
  or get preempted simply catch up later.

Exactness never depends on the draft: greedy verification keeps only tokens equal to the
target's argmax, and sampled drafts are drawn from the distribution q returned with them, so
rejection sampling stays exact whatever q is (a stale draft cache only lowers acceptance).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from argosy_runtime.attention.batch import build_batch, decode_rows_first
from argosy_runtime.models.build import build_model
from argosy_runtime.models.llama import ForwardContext, LlamaForCausalLM
from argosy_runtime.scheduler import ScheduledRequest
from argosy_runtime.spec_decode.config import SpeculativeConfig
from argosy_runtime.spec_decode.decoder import Proposal
from argosy_runtime.spec_decode.draft_cache import DraftCache, draft_max_positions, draft_num_layers

if TYPE_CHECKING:
    from argosy_runtime.engine import LLMEngine
    from argosy_runtime.request import Request

logger = logging.getLogger("argosy.spec_decode")


@dataclass
class _DraftState:
    """What a separate draft's cache holds for one request."""

    blocks: list  # the target's block list object: a new object means new target blocks
    valid: int = 0  # positions [0, valid) hold this request's draft K/V
    pending: list[int] = field(default_factory=list)  # drafts written at valid, valid + 1, ...


def load_draft_model(engine: LLMEngine, config: SpeculativeConfig) -> LlamaForCausalLM:
    """A separate draft (`config.has_own_cache`): `config.model`, or the target's checkpoint,
    quantized as `config.quantization` says, on the target's device."""
    from argosy_runtime.model_loader import load_checkpoint

    checkpoint = engine.checkpoint if config.model is None else load_checkpoint(config.model)
    spec = checkpoint.spec
    if spec.vocab_size != engine.spec.vocab_size:
        raise ValueError(
            f"speculative model {config.model!r} has vocab_size {spec.vocab_size}, but the "
            f"target has {engine.spec.vocab_size}: the draft must share the target's tokenizer"
        )
    quant_config = None
    if config.quantization is not None:
        from argosy_runtime.quantization import QuantizationConfig

        quant_config = QuantizationConfig(method=config.quantization)
    # On the target's device with the same fast kernels: a draft is only worth it if cheap.
    model = build_model(checkpoint, engine.dtype, engine.device,
                        draft_max_positions(spec, engine.max_model_len), quant_config)
    draft_num_layers(model, config)  # a bad draft_layers is refused before the cache is sized
    return model


class DraftProposer:
    """Proposes with a draft model; `SpeculativeDecoder` calls `propose_batch` each step."""

    def __init__(self, engine: LLMEngine, config: SpeculativeConfig,
                 draft_model: LlamaForCausalLM | None = None) -> None:
        """`draft_model`: a separate draft's (`load_draft_model`); None for a self-draft."""
        # A proxy: the engine owns this object, so a strong reference back would keep a
        # dropped engine (and its KV cache) alive until the garbage collector ran.
        self.engine = weakref.proxy(engine)
        self.config = config
        runner = engine.runner
        target = engine.model
        self.vocab_size = engine.spec.vocab_size
        self._state: dict[str, _DraftState] = {}
        if not config.has_own_cache:
            total = target.spec.num_hidden_layers
            n = config.draft_layers or max(1, total // 4)
            if n > total:
                raise ValueError(f"draft_layers ({n}) exceeds the target's {total} layers")
            self.shares_target_cache = True
            self.model = target
            self.num_layers = n
            self.max_positions = engine.max_model_len
            self.backend = runner.backend
            self.kv_caches = runner.kv_caches  # layers < n are read and written
            self.kv_scales = runner.kv_scales
            return
        self.shares_target_cache = False
        self.model = draft_model
        self.num_layers = draft_num_layers(draft_model, config)
        self.max_positions = draft_max_positions(draft_model.spec, engine.max_model_len)
        spec = draft_model.spec
        # The target's kind of backend (Triton on CUDA, the fused CPU kernels on the CPU).
        self.backend = type(runner.backend)(spec.num_attention_heads, spec.num_key_value_heads,
                                            spec.head_dim, spec.attention_scale)
        cc = engine.cache_config
        self.cache = DraftCache(draft_model, config, engine.max_model_len, cc.layout,
                                cc.num_blocks, cc.block_size, engine.dtype, engine.device)
        # Catch-ups longer than the target's step run in chunks of it: the draft's windowed
        # tables then give back what falls behind between chunks, as the target's do.
        self.catch_up_chunk = engine.scheduler_config.max_num_batched_tokens
        self.kv_caches = self.cache.kv_caches
        self.kv_scales = None
        layout = self.cache.layout
        logger.info("speculative draft cache: %d blocks, %d block table(s) on pages of %d "
                    "layers (%.0f MiB, from the KV budget)", self.cache.manager.num_blocks,
                    layout.num_tables, layout.page_layers, self.cache.kv.nbytes / 2**20)

    # ---- proposing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, batch: list[tuple[Request, int]]) -> list[Proposal]:
        """Up to k draft tokens per request (with their distribution q for sampled requests)."""
        kv = self.engine.kv_cache
        for rid in [r for r in self._state if r not in kv.req_to_blocks]:
            self.forget(rid)  # finished or preempted
        drafting = {req.request_id for req, _ in batch}
        proposals = [Proposal([]) for _ in batch]
        live: list[tuple[int, Request, int, np.ndarray]] = []  # (batch index, req, k, blocks)
        entries: list[tuple[np.ndarray, int, list[int]]] = []  # (block ids, first position, tokens)
        for i, (req, k) in enumerate(batch):
            n = req.num_tokens
            # Draft positions go up to n + k - 2 (the target verifies up to n + k - 1).
            k = min(k, self.max_positions - n + 1)
            if k <= 0:
                continue
            start = self._catch_up_start(req)
            if not self.shares_target_cache:
                start = self._catch_up_in_chunks(req, start, n + k, drafting)
                if start is None:
                    continue
            # A self-draft writes into the target's cache: it needs the target's blocks for
            # every position it writes (given back below, once it has proposed); a separate
            # draft writes its own cache only. Only the computed prefix is offered for
            # prefix-cache hashing: the block holding the last token must not become a cache
            # entry before the target has written it. The salt as the scheduler passes it:
            # accepted drafts can complete a request's first block, hashed here first, and an
            # unsalted hash would let a request on another LoRA adapter (or none) reuse this
            # adapter's K/V.
            if self.shares_target_cache and not kv.allocate_slots(
                    req.request_id, req.token_ids[: req.num_computed_tokens], n + k,
                    salt=req.cache_salt, num_computed_tokens=req.num_computed_tokens):
                continue
            own = kv if self.shares_target_cache else self.cache
            blocks = np.asarray(own.block_ids(req.request_id), dtype=np.int64)
            live.append((i, req, k, blocks))
            entries.append((blocks, start, req.token_ids[start:n]))
        if not live:
            return proposals

        drafts: list[list[int]] = [[] for _ in live]
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        for step in range(max(k for _, _, k, _ in live)):
            active = [j for j, (_, req, k, _) in enumerate(live)
                      if k > step and not self._drafts_ended(req, drafts[j])]
            if not active:
                break
            if step > 0:
                entries = [(live[j][3], live[j][1].num_tokens - 1 + step, [drafts[j][-1]])
                           for j in active]
            reqs = [live[j][1] for j in active]
            logits = self._forward(entries, reqs)  # [len(active), vocab]
            tokens, probs = self._choose(reqs, logits, [drafts[j] for j in active])
            for row, j in enumerate(active):
                drafts[j].append(tokens[row])
                if probs is not None and probs[row] is not None:
                    qs[j].append(probs[row])

        if self.shares_target_cache:
            # Give the target's blocks past the computed tokens back: the verification pass
            # rewrites every slot from there on, and the scheduler grants slots in priority
            # order, dropping a request's drafts before it preempts anyone for them. Held from
            # here, a request's drafts took the block a request ahead of it needed for its
            # next token, and the scheduler preempted someone for drafts it never granted.
            for _, req, _, _ in live:
                kv.truncate(req.request_id, req.num_computed_tokens)
        for j, (i, req, _, _) in enumerate(live):
            if not self.shares_target_cache:
                state = self._state[req.request_id]
                state.valid = req.num_tokens
                state.pending = drafts[j][:-1]  # the last draft was never fed to the draft
            probs = torch.stack(qs[j]) if qs[j] and len(qs[j]) == len(drafts[j]) else None
            proposals[i] = Proposal(drafts[j], probs)
        return proposals

    def _catch_up_start(self, req: Request) -> int:
        """First position the draft must (re)compute for this request."""
        if self.shares_target_cache:
            return req.num_computed_tokens  # the target's cache holds everything before
        blocks = self.engine.kv_cache.req_to_blocks[req.request_id]
        state = self._state.get(req.request_id)
        if state is None or state.blocks is not blocks:
            # New request, or preempted and re-admitted with new target blocks: recompute
            # from 0 (a preempted request's draft K/V are valid still, but cheap to redo).
            self.cache.free(req.request_id)
            state = self._state[req.request_id] = _DraftState(blocks)
        for token in state.pending:  # drafts the target accepted keep their draft K/V
            if state.valid < req.num_tokens and req.token_ids[state.valid] == token:
                state.valid += 1
            else:
                break
        state.pending = []
        # Drafts the target rejected sit past its computed tokens: recomputed.
        state.valid = min(state.valid, req.num_computed_tokens)
        return state.valid

    def _catch_up_in_chunks(self, req: Request, start: int, num_tokens: int,
                            drafting: set[str]) -> int | None:
        """Run the draft over its catch-up but the last `catch_up_chunk` tokens, a chunk at a
        time, then take the blocks of the request's first `num_tokens` positions for the rest
        and this step's drafts. Returns where the rest starts, or None when the draft's pool
        is short (the request goes undrafted this step; the chunks run stay done)."""
        rid = req.request_id
        while req.num_tokens - start > self.catch_up_chunk:
            end = start + self.catch_up_chunk
            if not self._allocate_draft_blocks(rid, end, start, drafting):
                return None
            blocks = np.asarray(self.cache.block_ids(rid), dtype=np.int64)
            self._forward([(blocks, start, req.token_ids[start:end])], [req])
            start = self._state[rid].valid = end
        return start if self._allocate_draft_blocks(rid, num_tokens, start, drafting) else None

    def _allocate_draft_blocks(self, request_id: str, num_tokens: int, start: int,
                               drafting: set[str]) -> bool:
        """Draft blocks for the request's first `num_tokens` positions (`start`: the first
        it computes). When the draft's pool is short and freeing the draft K/V of the requests
        not drafting this step makes room, they go, least recently drafted first (they catch
        up from 0 if they draft again); False, freeing nothing, when it would not."""
        cache = self.cache
        if not cache.allocate(request_id, num_tokens, start):
            idle = [rid for rid in self._state if rid not in drafting]
            if not cache.could_allocate(request_id, num_tokens, start, idle):
                logger.debug("draft cache full: request %s goes undrafted this step", request_id)
                return False
            for victim in idle:
                self.forget(victim)
                if cache.allocate(request_id, num_tokens, start):
                    break
            else:
                return False
        self._state[request_id] = self._state.pop(request_id)  # now the most recently drafted
        return True

    def forget(self, request_id: str) -> None:
        """Drop a request's draft K/V (a separate draft's blocks go back to its pool)."""
        if self._state.pop(request_id, None) is not None:
            self.cache.free(request_id)

    def _drafts_ended(self, req: Request, drafted: list[int]) -> bool:
        """Nothing after `drafted` can be accepted: it ends with an end token, or its grammar
        refuses it. Its grammar must not be fed tokens past either (`_choose` processes the
        next position after them): a refused token breaks the request's matcher for good."""
        if not drafted:
            return False
        # The engine's own end test: the model's end tokens end nothing under ignore_eos
        # (all_stop_token_ids is empty then), so a draft goes on past one.
        params = req.params
        if drafted[-1] in params.all_stop_token_ids or drafted[-1] in params.stop_token_ids:
            return True
        return (req.grammar is not None
                and len(req.grammar.valid_prefix(req.output_token_ids, drafted)) < len(drafted))

    def _choose(self, reqs: list[Request], logits: torch.Tensor, drafted: list[list[int]]
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Greedy requests take the draft's argmax; sampled ones draw from q and keep q. Both
        on the logits processed as the target's verification processes its own (penalties,
        logit_bias, token masks, the grammar; after the tokens `drafted` so far): from raw
        logits a draft proposed tokens a mask forbids, and none was accepted."""
        sampler = self.engine.runner.sampler
        logits = sampler.process_after(logits[:, : self.vocab_size], reqs, drafted)
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [r for r, req in enumerate(reqs) if not req.params.is_greedy]
        if not sampled:
            return tokens, None
        sub = [reqs[r] for r in sampled]
        q = sampler.probs(logits[sampled], sub)
        q = q / q.sum(dim=-1, keepdim=True)  # min-p zeroes entries: renormalize
        draws = sampler.sample_from(q, sub).tolist()
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for row, r in enumerate(sampled):
            tokens[r] = draws[row]
            probs[r] = q[row]
        return tokens, probs

    # ---- the draft forward ----------------------------------------------------------------
    def _forward(self, entries: list[tuple[np.ndarray, int, list[int]]],
                 reqs: list[Request]) -> torch.Tensor:
        """Run the draft over each entry's tokens (`reqs[e]`'s); float32 logits
        [len(entries), vocab] at each entry's last token."""
        dev = self.engine.device
        bs = self.engine.cache_config.block_size
        # Decode rows first: attention handles them with one paged-decode call.
        model = self.model
        rows_up_to = model.decode_rows_up_to
        order = decode_rows_first([len(tokens) for _, _, tokens in entries], rows_up_to)
        input_ids, pos_t, meta = build_batch([entries[e] for e in order], bs, dev, rows_up_to)
        ends = np.cumsum([len(entries[e][2]) for e in order]) - 1
        last_rows = [0] * len(entries)
        for row, e in zip(ends.tolist(), order):
            last_rows[e] = row
        ctx = ForwardContext(model.rotary, self.backend, self.kv_caches, meta, self.kv_scales)
        if self.shares_target_cache:
            # The target's own layers on the target's cache: a request's adapter applies in
            # them as in the target. Without it the draft's queries met the adapter's K/V and
            # nearly no draft of a LoRA request was accepted.
            ctx.lora = self.engine.runner._lora_batch(
                [ScheduledRequest(reqs[e], len(entries[e][2])) for e in order])
        h = model(input_ids, pos_t, ctx, num_layers=self.num_layers)
        return model.compute_logits(h[torch.tensor(last_rows, device=dev)]).cpu()

