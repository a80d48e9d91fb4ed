"""`LLMEngine`: requests in, one scheduled and executed step at a time, outputs out.

    engine = LLMEngine(model="smollm2-135m", dtype="float32")
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Not thread-safe: one thread calls add_request / step / abort_request (the server's
AsyncEngine funnels everything through its engine thread).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from argosy_runtime.bad_words import bad_words_token_ids
from argosy_runtime.batch_invariance import (
    check_batch_invariant_model,
    check_batch_invariant_options,
)
from argosy_runtime.config import CacheConfig, SchedulerConfig, resolve_device, resolve_dtype
from argosy_runtime.cpu_memory import available_memory
from argosy_runtime.cpu_threads import configure_cpu_threads
from argosy_runtime.detokenizer import IncrementalDetokenizer
from argosy_runtime.distributed import (
    ShardedCheckpoint,
    TensorParallelWorkers,
    WorkerConfig,
    check_tensor_parallel_options,
    kv_cache_budget,
)
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.kv_cache import kv_cache_layout, make_kv_cache_manager
from argosy_runtime.lora import LoRAAdapter, LoRAModulesFile
from argosy_runtime.lora.registry import LoRARegistry
from argosy_runtime.model_loader import ModelSpec
from argosy_runtime.model_runner import ModelRunner, kv_cache_bytes_per_block
from argosy_runtime.models import LlamaForCausalLM
from argosy_runtime.models.build import build_model
from argosy_runtime.outputs import (
    ClassificationOutput,
    CompletionOutput,
    EngineStats,
    RequestOutput,
)
from argosy_runtime.pooling_params import PoolingParams
from argosy_runtime.request import Request, RequestStatus
from argosy_runtime.sampling_params import SamplingParams
from argosy_runtime.scheduler import Scheduler
from argosy_runtime.structured_output.grammar import GrammarCompiler

if TYPE_CHECKING:
    from argosy_runtime.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("argosy.engine")

_CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30
MAX_LORA_NAME_CHARS = 256  # an adapter name: a model id, not a document
# The params an embedding request's Request carries: it never samples, so none apply.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def _stop_workers(workers: TensorParallelWorkers, threads_before: int) -> None:
    workers.close()
    torch.set_num_threads(threads_before)


class LLMEngine:
    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        self.args = EngineArgs.from_kwargs(model=model, **kwargs)
        args = self.args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype)
        self.cpu_threads = configure_cpu_threads(args.cpu_threads)
        if args.batch_invariant:
            check_batch_invariant_options(args, self.device, self.dtype)
        started = time.monotonic()

        from argosy_runtime.model_loader import load_checkpoint

        if args.hf_overrides is not None and not isinstance(args.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config.json fields, got "
                             f"{args.hf_overrides!r}")
        checkpoint = load_checkpoint(args.model, args.hf_overrides)
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.tokenizer = checkpoint.tokenizer
        if self.spec.is_encoder:  # BERT / XLM-R: every prompt whole in one step, no cache reuse
            from argosy_runtime.models.bert import check_encoder_options

            check_encoder_options(args)
        self.served_model_name = args.served_model_name or args.model
        self.max_model_len = self._max_model_len(args.max_model_len)
        # Built before the weights load: a token budget below max_model_len without chunked
        # prefill is refused at once rather than after minutes of loading.
        default_budget = 2048 if self.device.type == "cuda" else 512
        chunked = args.enable_chunked_prefill and not self.spec.is_encoder
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or (
                default_budget if chunked else max(default_budget, self.max_model_len)
            ),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=chunked,
            max_loras=args.max_loras,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        )
        quant_config = self._quantization_config(checkpoint)
        self.quantization = quant_config.method if quant_config is not None else "none"
        # Ranks 1..N-1 of a tensor-parallel engine (this process is rank 0), or None.
        self.tensor_parallel_workers: TensorParallelWorkers | None = None
        self._worker_kv_budgets: list[int | None] = []
        self.model = self._load_model(checkpoint, quant_config)
        if args.batch_invariant:
            check_batch_invariant_model(self.spec)
            self.model.use_batch_invariant_kernels()

        speculative = self._speculative_config()
        # A separate draft model loads before the KV cache is sized: on a GPU its weights
        # must not be counted as cache memory, and its own cache (spec_decode/draft_cache.py)
        # shares the budget.
        draft_model = self._load_draft_model(speculative)

        cache_dtype = torch.int8 if args.kv_cache_dtype == "int8" else self.dtype
        # Windowed layers give back the blocks behind their window as a request advances:
        # on one block table when every layer has the same window (Mistral, Phi-3-mini-4k),
        # on tables of their own beside the full layers' otherwise (Gemma 2/3).
        layout = kv_cache_layout(self.spec.layer_sliding_windows, self.spec.num_hidden_layers,
                                 self.max_model_len)
        bytes_per_block = kv_cache_bytes_per_block(self.model, args.block_size, cache_dtype,
                                                   layout.page_layers)
        draft_bytes = 0.0  # the draft cache's bytes per target page
        if draft_model is not None:
            from argosy_runtime.spec_decode.draft_cache import draft_cache_bytes_per_target_page

            draft_bytes = draft_cache_bytes_per_target_page(
                draft_model, speculative, self.max_model_len, layout, args.block_size, self.dtype)
        if self.spec.is_encoder:  # no KV tensor (models/bert.py): blocks for a full batch
            num_blocks = args.max_num_seqs * -(-self.max_model_len // args.block_size)
        else:
            num_blocks = int(self._kv_cache_memory() // (bytes_per_block + draft_bytes))
        self.cache_config = CacheConfig(args.block_size, int(num_blocks), cache_dtype,
                                        args.enable_prefix_caching and not self.spec.is_encoder,
                                        layout)
        if self.tensor_parallel_workers is not None:  # every rank's cache has the same blocks
            self.tensor_parallel_workers.allocate(self.cache_config)
        self.kv_cache = make_kv_cache_manager(self.cache_config.num_blocks, args.block_size,
                                              self.cache_config.enable_prefix_caching, layout)
        if layout.is_hybrid:
            logger.info("KV cache: %d block tables (windows %s) on pages of %d layers",
                        layout.num_tables, ", ".join(str(w or "full") for w in
                                                     layout.table_windows), layout.page_layers)
        self.runner = ModelRunner(self.model, self.cache_config, self.kv_cache, self.device,
                                  self.spec.vocab_size, seed=args.seed,
                                  max_model_len=self.max_model_len,
                                  enable_cuda_graphs=not args.enforce_eager,
                                  batch_invariant=args.batch_invariant,
                                  tensor_parallel_workers=self.tensor_parallel_workers)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache)
        self.proposer = self._build_proposer(speculative, draft_model)

        self._groups: dict[str, list[Request]] = {}  # parent request id -> its n sequences
        self._stop_ids = set(self.tokenizer.eos_token_ids) | set(self.spec.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.spec.vocab_size,
                                                self._stop_ids)
        self._load_lora_adapters()
        # Adapters from a file the server re-reads while it runs (lora/modules_file.py).
        self.lora_modules_file: LoRAModulesFile | None = None
        if args.lora_modules_file:
            self.lora_modules_file = LoRAModulesFile(args.lora_modules_file)
            self.lora_modules_file.sync(self)
        self.stats = EngineStats(block_size=args.block_size, num_gpu_blocks=self.cache_config.num_blocks)
        logger.info(
            "engine ready in %.1fs: model=%s device=%s tensor_parallel=%d cpu_threads=%d "
            "fused_cpu_ops=%s "
            "layer_ops=%s attention=%s batch_invariant=%s dtype=%s "
            "quantization=%s kv_cache=%s blocks=%d x %d tokens (%.0f MiB), max_model_len=%d",
            time.monotonic() - started, args.model, self.device, args.tensor_parallel_size,
            self.cpu_threads,
            getattr(self.runner.backend, "fused_cpu_ops", False), self.model.ops,
            type(self.runner.backend).__name__, args.batch_invariant, self.dtype, self.quantization,
            cache_dtype, self.cache_config.num_blocks, args.block_size,
            self.cache_config.num_blocks * bytes_per_block / 2**20, self.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(**args.to_dict())

    # ---- construction helpers -------------------------------------------------------------
    def _load_model(self, checkpoint: Any, quant_config: Any) -> LlamaForCausalLM:
        size = self.args.tensor_parallel_size
        if size == 1:
            return build_model(checkpoint, self.dtype, self.device, self.max_model_len,
                               quant_config)
        # Tensor parallel: the workers load their shards while this process loads rank 0's.
        check_tensor_parallel_options(self.args, self.device, checkpoint, quant_config)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)
        threads_before = torch.get_num_threads()
        self.cpu_threads = max(1, self.cpu_threads // size)  # the ranks share the CPUs
        torch.set_num_threads(self.cpu_threads)
        workers = TensorParallelWorkers(WorkerConfig(
            model=self.args.model, hf_overrides=self.args.hf_overrides, dtype=self.dtype,
            device_type=self.device.type, max_model_len=self.max_model_len,
            quant_config=quant_config, cpu_threads=self.cpu_threads, world_size=size,
            kv_cache_memory_fraction=self.args.kv_cache_memory_fraction))
        self.tensor_parallel_workers = workers
        # Stopped by shutdown(), or when this engine is collected or the process exits; the
        # process's thread count is given back then.
        self._stop_workers = weakref.finalize(self, _stop_workers, workers, threads_before)
        try:
            model = build_model(ShardedCheckpoint(checkpoint, 0, size), self.dtype, self.device,
                                self.max_model_len, quant_config)
            self._worker_kv_budgets = workers.wait_ready()
            model.use_tensor_parallel(workers.connect(self.device))
        except BaseException:
            workers.close(timeout=2.0)
            self._stop_workers()
            raise
        logger.info("tensor parallel: %d ranks, %d heads, %d KV heads and %d MLP columns each",
                    size, model.spec.num_attention_heads, model.spec.num_key_value_heads,
                    model.spec.intermediate_size)
        return model

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine runs no more steps)."""
        if self.tensor_parallel_workers is not None:
            self._stop_workers()

    def _max_model_len(self, requested: int | None) -> int:
        """`--max-model-len`, or the model's trained context when unset; a longer request is
        refused. Sliding-window layers attend through their window at any length."""
        spec = self.spec
        if requested is None:
            return spec.max_position_embeddings
        if requested > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({requested}) exceeds the model's context length "
                f"({spec.max_position_embeddings})"
            )
        return requested

    def _quantization_config(self, checkpoint: Any) -> Any:
        """The requested quantization, or the checkpoint's own (GPTQ/AWQ), or None."""
        if self.args.quantization is None:
            from argosy_runtime.quantization import detect_prequantized

            return detect_prequantized(checkpoint)
        # (EngineArgs checked the method when it was built: check_engine_options)
        from argosy_runtime.quantization import QuantizationConfig

        return QuantizationConfig(method=self.args.quantization,
                                  group_size=self.args.quantization_group_size)

    def _kv_cache_memory(self) -> int:
        if self.args.kv_cache_memory is not None:
            if self.args.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be > 0 bytes")
            if self.device.type == "cpu":  # touched at once: past the memory left, a silent kill
                available = available_memory()
                if available is not None and self.args.kv_cache_memory > available:
                    raise ValueError(
                        f"kv_cache_memory ({self.args.kv_cache_memory / 2**30:.2f} GiB) is "
                        f"more than this machine has available ({available / 2**30:.2f} GiB "
                        "after the model loaded); give a smaller --kv-cache-memory")
            return self.args.kv_cache_memory
        if self.device.type == "cuda":  # every rank's cache alike: the smallest budget
            return min([kv_cache_budget(self.device, self.args.kv_cache_memory_fraction)]
                       + [b for b in self._worker_kv_budgets if b is not None])
        return _CPU_DEFAULT_KV_CACHE_MEMORY

    def _load_lora_adapters(self) -> None:
        modules = self.args.lora_modules or {}
        if not isinstance(modules, dict):
            raise ValueError("lora_modules must map adapter names to PEFT adapter folders")
        # name -> path of every adapter served, and the ones in memory now (all of them
        # unless max_loaded_loras caps them: then loaded on first use, least recently used
        # evicted; lora/registry.py).
        # The loader holds no reference to the engine: an engine nothing else holds (a
        # dropped `LLM`) is freed at once, its KV cache with it, without waiting for the
        # garbage collector to find a cycle.
        self.lora_registry = LoRARegistry(
            functools.partial(_read_lora_adapter, spec=self.spec, dtype=self.dtype,
                              device=self.device, max_rank=self.args.max_lora_rank),
            self.args.max_loaded_loras, self.args.max_lora_rank)
        # False: add_request never reads adapter weights on its thread (the AsyncEngine sets
        # it and loads adapters on short-lived threads before it posts their requests).
        self.lora_loads_inline = True
        # Requests whose adapter waits for a free slot (max_loaded_loras, all held):
        # (adapter name, the request's sequences), admitted in order by step().
        self._lora_waiting: list[tuple[str, list[Request]]] = []
        for name, path in modules.items():
            self.load_lora_adapter(name, path)

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end generation unless ignore_eos: the tokenizer's and the model
        config's end-of-sequence ids."""
        return frozenset(self._stop_ids)

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapter]:
        """The adapters in memory now, by name (every served one without max_loaded_loras)."""
        return self.lora_registry.loaded

    @property
    def lora_paths(self) -> dict[str, str]:
        """Every adapter served, loaded or not: name -> path."""
        return self.lora_registry.paths

    def load_lora_adapter(self, name: str, path: str) -> LoRAAdapter | None:
        """Serve the PEFT adapter folder `path` as `name` (replacing one of that name).

        Without max_loaded_loras the weights are loaded now and the adapter returned; with
        it, only what needs no weights is checked (lora/registry.py `check_registrable`),
        the first request naming it loads it, and None is returned.
        Callable from any thread while the engine runs: the name -> adapter map is replaced,
        never mutated, so a step sees the old map or the new one; requests already admitted
        keep the adapter object they started with. ValueError names what is wrong."""
        if (not isinstance(name, str) or not name.strip() or name == self.served_model_name
                or len(name) > MAX_LORA_NAME_CHARS or any(c < " " or c == "\x7f" for c in name)):
            # Control characters too: a name is a `model` in requests and /v1/models and a
            # Prometheus label value, where a NUL or a newline breaks the exposition.
            raise ValueError(f"lora_name: {name!r} is not a usable adapter name (blank, "
                             f"longer than {MAX_LORA_NAME_CHARS} characters, with control "
                             "characters, or the base model's own name)")
        if self.tensor_parallel_workers is not None:
            raise ValueError("LoRA adapters cannot be served with tensor_parallel_size > 1 "
                             "(their weights are not split over the ranks)")
        return self.lora_registry.register(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError if it is not served). Requests already
        admitted on it finish on it; new ones get the unknown-adapter error."""
        self.lora_registry.unregister(name)
        logger.info("LoRA adapter %s unloaded", name)

    def _speculative_config(self) -> SpeculativeConfig | None:
        if self.args.speculative is None:
            return None
        if not self.spec.has_lm_head:
            raise ValueError("speculative: a headless embedding or a classification "
                             "checkpoint has no language-model head: it generates nothing to "
                             "speculate on; leave speculative out")
        from argosy_runtime.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_user(self.args.speculative)

    def _load_draft_model(self, speculative: SpeculativeConfig | None
                          ) -> LlamaForCausalLM | None:
        """A separate draft model, or None."""
        if speculative is None or not speculative.has_own_cache:
            return None
        from argosy_runtime.spec_decode.draft_proposer import load_draft_model

        return load_draft_model(self, speculative)

    def _build_proposer(self, speculative: SpeculativeConfig | None,
                        draft_model: LlamaForCausalLM | None) -> Any:
        if speculative is None:
            return None
        from argosy_runtime.spec_decode import build_proposer

        return build_proposer(self, speculative, draft_model)

    # ---- public API --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        """Queue a request, on the base model or the LoRA adapter `lora_name`: a generation
        (SamplingParams) or a pooling request (PoolingParams: its output has `embedding`, or
        `classification` for task "classify", and no tokens). Raises ValueError (naming the
        field) for input that can never run."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise ValueError("params must be a SamplingParams or a PoolingParams")
        self._check_task(params)
        self._check_sequence_ids_free(request_id, params)
        if lora_name is not None and lora_name not in self.lora_paths:
            raise ValueError(f"lora_name: no LoRA adapter {lora_name!r}; serving "
                             f"{sorted(self.lora_paths) or 'none'}")
        prompt_text, prompt_ids = self._tokenize(prompt)
        if isinstance(params, PoolingParams):
            self._add_embedding_request(request_id, prompt_text, prompt_ids, params,
                                        arrival_time, priority, lora_name)
            return
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise ValueError(
                    f"prompt has {len(prompt_ids)} tokens, which leaves no room to generate "
                    f"within max_model_len ({self.max_model_len})"
                )
        elif len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        blocks_needed = self._max_blocks_held(len(prompt_ids) + max_tokens)
        if blocks_needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {blocks_needed} KV-cache blocks but the whole pool "
                f"has {self.kv_cache.num_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids",
                                                               params.allowed_token_ids)):
            for t in ids or ():
                if t >= self.spec.vocab_size:
                    raise ValueError(f"{name}: token id {t} is outside the vocabulary "
                                     f"[0, {self.spec.vocab_size})")
        params = params.clone()
        params.all_stop_token_ids = set() if params.ignore_eos else set(self._stop_ids)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words,
                                                             self.spec.vocab_size)
        grammars = None
        if params.structured_outputs is not None:
            grammars = [self.grammar_compiler.compile(params.structured_outputs)
                        for _ in range(params.n)]
        children = []
        for i in range(params.n):
            child = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_ids, params=params, max_tokens=max_tokens,
                prompt=prompt_text, arrival_time=arrival_time, priority=priority,
                index=i, parent_id=request_id,
            )
            if params.seed is not None:
                child.generator = torch.Generator().manual_seed((params.seed + i) % (1 << 63))
            child.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                       params.skip_special_tokens)
            if grammars is not None:
                child.grammar = grammars[i]
            children.append(child)
        if lora_name is not None and not self._hold_lora(lora_name, children):
            self._lora_waiting.append((lora_name, children))  # all loaded adapters held
        else:
            for child in children:
                self.scheduler.add_request(child)
        self._groups[request_id] = children

    def _check_sequence_ids_free(self, request_id: str,
                                 params: SamplingParams | PoolingParams) -> None:
        """The sequences of n > 1 run as "<id>#<i>", and sequence ids key the scheduler and
        the KV block tables: a request named like another's live sequence ("a#1" beside "a"
        with n=2), or whose sequences would be named like a live request, would share its
        block table and overwrite its K/V. Refused like any id in use."""
        n = params.n if isinstance(params, SamplingParams) else 1
        seq_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        for sid in seq_ids:
            if sid in self.scheduler.requests or any(
                    c.request_id == sid for _, children in self._lora_waiting for c in children):
                raise ValueError(f"request_id {request_id!r} is already in use (sequence "
                                 f"{sid!r} is running)")

    def _max_blocks_held(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of `num_tokens` tokens holds at once, over all its
        block tables: all of them, or on a table that frees blocks behind a sliding window,
        the window plus one step's tokens (a prefill chunk, or a decode with its drafts).
        Without chunked prefill a preempted request recomputes all its tokens in one step:
        all of them."""
        sc = self.scheduler_config
        step = num_tokens
        if sc.enable_chunked_prefill:
            step = sc.max_num_batched_tokens
            if self.proposer is not None:  # drafts get slots before the step's budget cuts them
                step = max(step, 1 + self.proposer.config.num_speculative_tokens)
        return self.kv_cache.max_blocks_held(num_tokens, step)

    def _check_task(self, params: SamplingParams | PoolingParams) -> None:
        """What this checkpoint can do: generate with an lm_head, classify with a
        classification head, embed with neither (a headless decoder). vLLM refuses
        embeddings on a classifier too: its hidden state was trained for its head."""
        name, spec = self.served_model_name, self.spec
        task = params.task if isinstance(params, PoolingParams) else "generate"
        if spec.num_labels and task != "classify":
            raise ValueError(f"model: {name} is a sequence-classification checkpoint: it serves "
                             "classification and cross-encoder scores only (LLM.classify, POST "
                             "/v1/classify, /v1/score, /v1/rerank), not "
                             f"{'generation' if task == 'generate' else 'embeddings'}")
        if task == "generate" and not spec.has_lm_head:
            raise ValueError(f"model: {name} has no language-model head (a headless embedding "
                             "checkpoint): it serves embeddings only (LLM.embed, POST "
                             "/v1/embeddings), not generation")
        if task == "classify" and not spec.num_labels:
            raise ValueError(f"model: {name} has no classification head (not a "
                             "*ForSequenceClassification checkpoint): it cannot classify")

    def _add_embedding_request(self, request_id: str, prompt_text: str | None,
                               prompt_ids: list[int], params: PoolingParams,
                               arrival_time: float | None, priority: int,
                               lora_name: str | None) -> None:
        """Queue a request that runs its prompt and pools its hidden states (pooler.py):
        one sequence, no output tokens, so only the prompt needs room."""
        params = self.spec_pooling(params)
        if params.dimensions is not None:
            self._check_embedding_dimensions(params.dimensions)
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        if params.token_type_start is not None:
            if not self.spec.takes_token_types:
                raise ValueError(f"token_type_start: {self.served_model_name} has no second "
                                 "token type (only a BERT-style encoder reads a pair's types)")
            if params.token_type_start > len(prompt_ids):
                raise ValueError(f"token_type_start ({params.token_type_start}) is past the "
                                 f"prompt's {len(prompt_ids)} tokens")
        blocks_needed = self._max_blocks_held(len(prompt_ids))
        if blocks_needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt needs {blocks_needed} KV-cache blocks but the whole pool has "
                f"{self.kv_cache.num_blocks}; raise kv_cache_memory")
        # max_tokens 0: nothing to generate, so a speculative proposer never drafts for it
        # (not even when a chunk leaves one prompt token for the next step).
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids,
                          params=_NO_SAMPLING, max_tokens=0, prompt=prompt_text,
                          arrival_time=arrival_time, priority=priority)
        request.pooling = params
        if lora_name is not None and not self._hold_lora(lora_name, [request]):
            self._lora_waiting.append((lora_name, [request]))  # all loaded adapters held
        else:
            self.scheduler.add_request(request)
        self._groups[request_id] = [request]

    def spec_pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` with what it leaves to the model filled in: the pooling (a decoder's last
        token; an encoder's sentence-transformers pooling, else [CLS]; an encoder classifier
        reads [CLS]) and whether to normalize (an encoder's Normalize module; else yes)."""
        spec = self.spec
        pooling, normalize = params.pooling, params.normalize
        if pooling is None:
            if not spec.is_encoder:
                pooling = "last"
            else:
                pooling = "cls" if params.task == "classify" else (spec.pooling_type or "cls")
        if normalize is None:
            normalize = spec.pooling_normalize
        if pooling == "cls" and not spec.is_encoder:  # a chunk's first row is not the prompt's
            raise ValueError(f"pooling: 'cls' is for encoder-only models (BERT, XLM-RoBERTa); "
                             f"{self.served_model_name} is a decoder: use 'last' or 'mean'")
        if params.task == "classify" and pooling != ("cls" if spec.is_encoder else "last"):
            raise ValueError(f"pooling: {self.served_model_name}'s classification head reads "
                             f"the {'first' if spec.is_encoder else 'last'} token; leave "
                             "pooling unset")
        return dataclasses.replace(params, pooling=pooling, normalize=normalize)

    def _check_embedding_dimensions(self, dims: int) -> None:
        spec = self.spec
        if spec.accepts_embedding_dimensions(dims):
            return
        if spec.matryoshka_dimensions is None:
            raise ValueError(
                f"dimensions: {self.served_model_name} makes {spec.hidden_size}-value embeddings "
                f"and was not trained to shorten them (to {dims}); a Matryoshka-trained model "
                "says so in config.json (is_matryoshka, matryoshka_dimensions) or through "
                "--hf-overrides")
        sizes = list(spec.matryoshka_dimensions) or f"1..{spec.hidden_size}"
        raise ValueError(f"dimensions: {self.served_model_name} embeddings can be shortened to "
                         f"{sizes} values (or kept at {spec.hidden_size}), not {dims}")

    def _hold_lora(self, name: str, children: list[Request]) -> bool:
        """Give `children` the adapter `name`, held until each finishes (loading it here,
        unless lora_loads_inline is off); False when every loaded adapter is held."""
        adapter = self.lora_registry.acquire(name, len(children), wait=False,
                                             load=self.lora_loads_inline)
        if adapter is None:
            if not self.lora_loads_inline:  # evicted or replaced since the caller held it
                raise ValueError(f"lora_name: LoRA adapter {name!r} is not loaded; retry")
            return False
        for child in children:
            child.lora = adapter
        return True

    def _admit_lora_waiting(self) -> None:
        """Admit, oldest first, the waiting requests whose adapter can be held now (loading
        it). One whose adapter is gone or fails to load is dropped and its error raised."""
        still, error = [], None
        for name, children in self._lora_waiting:
            try:
                held = error is None and self._hold_lora(name, children)
            except ValueError as exc:  # unregistered meanwhile, or its load failed
                for child in children:
                    child.status = RequestStatus.FINISHED_ABORTED
                self._groups.pop(children[0].parent_id, None)
                error = exc
                continue
            if held:
                for child in children:
                    self.scheduler.add_request(child)
            else:
                still.append((name, children))
        self._lora_waiting = still
        if error is not None:
            raise error

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        if self.proposer is not None:
            self.proposer.finish(req.request_id)
        if req.lora is not None:
            self.lora_registry.release(req.lora.name)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now; their KV blocks return to the pool. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            children = self._groups.pop(rid, [])
            self._lora_waiting = [w for w in self._lora_waiting if w[1] is not children]
            for child in children:
                if not child.is_finished:
                    self._finish(child, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._lora_waiting) or self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; return every request that produced output."""
        if self._lora_waiting:
            self._admit_lora_waiting()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if sched.is_empty:
            return []
        now = time.monotonic()
        try:
            result = self.runner.execute(sched)
        except BaseException:
            # The blocks hashed for this step hold no (or partial) K/V: no later request may
            # find them in the prefix cache once these requests are aborted.
            self.kv_cache.unhash_step_blocks()
            raise
        progressed: dict[str, None] = {}
        for sr in sched.scheduled:
            req = sr.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if req.request_id in result.prompt_logprobs:
                req.prompt_logprobs.extend(result.prompt_logprobs[req.request_id])
            if req.pooling is not None:
                req.num_computed_tokens += sr.num_new_tokens
                self._count_prompt(req)
                if req.request_id in result.pooled:
                    req.pooled = result.pooled[req.request_id]
                    req.metrics.finished_time = now
                    self._finish(req, RequestStatus.FINISHED_STOPPED)
                    progressed[req.parent_id] = None
                continue
            if sr.num_spec_tokens:
                tokens, logprobs = self.proposer.verify(sr, result.spec_logits[req.request_id])
            else:
                req.num_computed_tokens += sr.num_new_tokens
                tokens = result.sampled.get(req.request_id, [])
                logprobs = result.logprobs.get(req.request_id)
            self._count_prompt(req)
            if not tokens:
                if req.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                    # A prompt-only request: its prompt (and its prompt logprobs) is done.
                    self._finish(req, RequestStatus.FINISHED_LENGTH)
                    req.metrics.finished_time = now
                    progressed[req.parent_id] = None
                continue
            self._append_tokens(req, tokens, logprobs)
            self._jump_forward(req)
            progressed[req.parent_id] = None
        return [self._make_output(pid) for pid in progressed]

    def _count_prompt(self, req: Request) -> None:
        """Count a request's prompt in `prompt_tokens` once it is prefilled (as vLLM does), so
        requests aborted while they waited (a client gone, a queue timeout) are not prompt
        throughput. Its n sequences share one prompt: the first one counts it."""
        if req.index == 0 and not req.prompt_counted \
                and req.num_computed_tokens >= req.num_prompt_tokens:
            req.prompt_counted = True
            self.stats.prompt_tokens += req.num_prompt_tokens

    def get_stats(self) -> EngineStats:
        """A snapshot (a copy: the engine keeps updating its own counters)."""
        s = self.stats
        s.num_requests_running = self.scheduler.num_running
        # Sequences waiting for a LoRA adapter slot (outside the scheduler) wait too.
        lora_waiting = [child for _, children in self._lora_waiting for child in children]
        s.num_requests_waiting = self.scheduler.num_waiting + len(lora_waiting)
        by_priority = collections.Counter(self.scheduler.num_waiting_by_priority())
        by_priority.update(child.priority for child in lora_waiting)
        s.num_waiting_by_priority = dict(by_priority)
        s.kv_cache_usage = self.kv_cache.usage()
        s.prefix_cache_queries = self.kv_cache.prefix_cache_queries
        s.prefix_cache_hits = self.kv_cache.prefix_cache_hits
        s.num_preemptions = self.scheduler.num_preemptions
        return dataclasses.replace(s, extra=dict(s.extra))

    def cache_config_info(self) -> dict[str, str]:
        c = self.cache_config
        return {
            "block_size": str(c.block_size),
            "num_gpu_blocks": str(c.num_blocks),
            "cache_dtype": str(c.cache_dtype).replace("torch.", ""),
            "enable_prefix_caching": str(c.enable_prefix_caching),
            "dtype": str(self.dtype).replace("torch.", ""),
            "quantization": self.quantization,
            "device": str(self.device),
            "max_model_len": str(self.max_model_len),
        }

    # ---- internals ---------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt must not be empty (it tokenized to no tokens)")
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.spec.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt[{i}] = {t!r} is not a token id in [0, {vocab})")
        return None, list(prompt)

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list | None) -> None:
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        for i, token in enumerate(tokens):
            req.token_ids.append(token)
            self.stats.generation_tokens += 1
            if req.logprobs is not None and logprobs is not None and i < len(logprobs):
                entry = logprobs[i]
                req.logprobs.append(entry)
                req.cumulative_logprob += entry[token].logprob
            # The model's end token that stops the request is not text (as in vLLM): kept
            # special tokens (skip_special_tokens=False) would end the reply with <|im_end|>.
            ends = (token in req.params.all_stop_token_ids
                    and req.num_output_tokens >= req.params.min_tokens)
            # Checked first: a failed grammar's mask allows anything (EOS included), and
            # its output must never end as a normal "stop".
            error = None if req.grammar is None else req.grammar.error(req.output_token_ids)
            if error is not None:
                params = req.params
                # Token masks can leave no token the grammar allows: then the sampled token
                # breaks it, and the hint is about the masks, not the grammar's size.
                hint = ("allowed_token_ids / bad_words may exclude every token the grammar "
                        "allows next" if params.allowed_token_ids or params.bad_words_token_ids
                        else "use smaller repetition counts, lengths or nesting")
                req.error = (f"structured_outputs: the grammar failed after "
                             f"{req.num_output_tokens} generated token(s) ({error}); {hint}")
                req.text += req.detokenizer.push([token])  # the text follows token_ids
                status = RequestStatus.FINISHED_ERROR
            elif ends:
                if req.params.include_stop_str_in_output:  # as vLLM: its text too (shown
                    req.text += req.detokenizer.push([token])  # when special tokens are)
                status = RequestStatus.FINISHED_STOPPED
            else:
                status = self._check_stop(req, token, req.detokenizer.push([token]))
            if status is not None:
                if not isinstance(req.stop_reason, str):  # (a stop string already cut the text)
                    req.text += req.detokenizer.flush()  # a trailing partial character
                self._finish(req, status)
                req.metrics.finished_time = now
                return

    def _jump_forward(self, req: Request) -> None:
        """Append the tokens a structured output's grammar forces next. They are output tokens
        like sampled ones; the next step feeds them all at once (like a prompt chunk) and
        samples after the last, so a JSON key costs one step instead of one per token. Greedy
        outputs are unchanged: where bytes are forced the grammar allows only these tokens.
        A request with token masks (allowed_token_ids, bad_words) never jumps: a forced token
        must pass its masks like a sampled one."""
        if not self.jumps_forward(req):
            return
        forced = req.grammar.forced_tokens(req.output_token_ids)
        if forced:  # _append_tokens stops at max_tokens / max_model_len / a stop string
            self._append_tokens(req, forced, None)

    def jumps_forward(self, req: Request) -> bool:
        """Whether `_jump_forward` appends the tokens `req`'s grammar forces (drawing nothing
        for them): a speculative proposer must not make a sampled request draw there."""
        params = req.params
        return not (req.grammar is None or req.is_finished or req.logprobs is not None
                    or params.allowed_token_ids or params.bad_words_token_ids
                    or not self.args.enable_jump_forward)

    def _check_stop(self, req: Request, token: int, delta: str) -> RequestStatus | None:
        """Whether `token` (text `delta`) ends `req` by a user stop, its grammar or its length
        (the model's end token is decided before, in `_append_tokens`)."""
        params = req.params
        text_before = req.text
        req.text += delta
        if token in params.stop_token_ids and req.num_output_tokens >= params.min_tokens:
            req.stop_reason = token
            if not params.include_stop_str_in_output:
                # As vLLM: the stop token is in token_ids, its text is not (nor any
                # character it was completing).
                req.text = text_before
                req.detokenizer.flush()
            return RequestStatus.FINISHED_STOPPED
        finished = None
        if req.grammar is not None and req.grammar.is_done(req.output_token_ids):
            finished = RequestStatus.FINISHED_STOPPED  # the structured output is complete
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            finished = RequestStatus.FINISHED_LENGTH
        if finished is not None:
            # The text held back for an incomplete character is final now: a stop string in
            # it must end the output like one in any other text (it was left in, as "length").
            req.text += req.detokenizer.flush()
        if self._find_stop_string(req, text_before):
            return RequestStatus.FINISHED_STOPPED
        return finished

    @staticmethod
    def _find_stop_string(req: Request, text_before: str) -> bool:
        """Whether a stop string ends in the text added after `text_before`; if so, cut the
        text there (after it with include_stop_str_in_output) and set `req.stop_reason`.
        As vLLM, stop strings ending in the text of the first min_tokens tokens are ignored."""
        params = req.params
        if not params.stop or len(req.text) == len(text_before) or \
                req.num_output_tokens <= params.min_tokens:
            return False
        # Each stop string is looked for only where it would end in the new text: one window
        # for all (the longest stop's) found a short one wholly in text that min_tokens had
        # kept from being searched, cutting the output back to before it.
        found = [(idx, stop) for stop in params.stop
                 if (idx := req.text.find(stop, max(0, len(text_before) - len(stop) + 1))) != -1]
        if not found:
            return False
        # The first to appear in the text (one token's text can hold two), so the output
        # holds none: OpenAI's rule.
        idx, stop = min(found, key=lambda f: f[0])
        end = idx + len(stop) if params.include_stop_str_in_output else idx
        req.text = req.text[:end]
        req.stop_reason = stop
        return True

    def _make_output(self, parent_id: str) -> RequestOutput:
        children = self._groups[parent_id]
        first = children[0]
        if first.pooling is not None:  # a pooling request: finished once it has its output
            del self._groups[parent_id]
            classify = first.pooling.task == "classify"
            classification = (ClassificationOutput.from_logits(first.pooled, self.spec.id2label,
                                                               self.spec.problem_type)
                              if classify else None)
            return RequestOutput(
                request_id=parent_id, prompt=first.prompt,
                prompt_token_ids=first.prompt_token_ids, outputs=[], finished=True,
                num_cached_tokens=max(first.num_cached_tokens, 0), metrics=first.metrics,
                embedding=None if classify else first.pooled,
                classification=classification)
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=c.logprobs,
                finish_reason=c.status.value if c.is_finished else None,
                stop_reason=c.stop_reason,
                error=c.error,
            )
            for c in children
        ]
        finished = all(c.is_finished for c in children)
        if finished:
            del self._groups[parent_id]
        return RequestOutput(
            request_id=parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            # The sequences score the same prompt; the furthest along has them all first
            # (a preempted first sequence may lag another that already finished).
            prompt_logprobs=max((c.prompt_logprobs for c in children),
                                key=lambda lp: -1 if lp is None else len(lp)),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=first.metrics,
        )


def _read_lora_adapter(name: str, path: str, *, spec: ModelSpec, dtype: torch.dtype,
                       device: torch.device, max_rank: int | None) -> LoRAAdapter:
    adapter = LoRAAdapter.load(name, path, spec, dtype, device, max_rank)
    logger.info("LoRA adapter %s: rank %d, %d layers, from %s", name, adapter.rank,
                len(adapter.layers), path)
    return adapter
