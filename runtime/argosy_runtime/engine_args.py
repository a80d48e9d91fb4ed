"""Every engine option in one place: `LLM(...)`, `LLMEngine(...)` and `argosy serve` flags.

`argosy serve` builds its flags from these fields (`add_cli_args`), so a new engine option is
reachable from the command line the moment it is added here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m"


def _opt(help: str, aliases: tuple[str, ...] = (), **kw: Any) -> Any:
    return field(metadata={"help": help, "aliases": aliases}, **kw)


@dataclass
class EngineArgs:
    model: str = _opt(
        "Model: a Hugging Face folder (config.json + safetensors), a .gguf file, or the "
        "alias 'smollm2-135m' (the embedded SmolLM2-135M-Instruct).",
        default=DEFAULT_MODEL,
    )
    served_model_name: str | None = _opt(
        "Name clients use in the 'model' field (default: the --model value).", default=None
    )
    hf_overrides: dict[str, Any] | None = _opt(
        "JSON object replacing fields of the model folder's config.json (vLLM's "
        "--hf-overrides), e.g. '{\"is_matryoshka\": true}' for an embedding model trained "
        "to be shortened (Qwen3-Embedding), or a rope_scaling to serve a longer context. "
        "Top-level fields are replaced whole. Hugging Face folders only (default: none).",
        default=None,
    )
    dtype: str = _opt(
        "Weight and activation dtype: auto (bfloat16 on CPU and CUDA), float32, float16, "
        "bfloat16.",
        default="auto",
    )
    device: str = _opt("cpu, cuda, or auto (cuda when available).", default="auto")
    quantization: str | None = _opt(
        "Weight-only quantization: int8 (per channel) or int4 (group-wise); default none.",
        default=None,
    )
    quantization_group_size: int = _opt("Group size for int4 (32, 64 or 128).", default=128)
    kv_cache_dtype: str = _opt("KV cache dtype: auto (same as dtype) or int8.", default="auto")
    block_size: int = _opt("Tokens per KV-cache block.", default=16)
    kv_cache_memory: int | None = _opt(
        "Bytes of memory for the KV cache, a separate speculative draft's included "
        "(default: 1 GiB on CPU; on CUDA, --kv-cache-memory-fraction of free memory).",
        default=None,
    )
    kv_cache_memory_fraction: float = _opt(
        "On CUDA, the fraction of free device memory (after the weights, a draft's "
        "included) given to the KV cache.",
        default=0.85,
    )
    enable_prefix_caching: bool = _opt("Reuse KV blocks of shared prompt prefixes.", default=True)
    max_model_len: int | None = _opt(
        "Longest prompt + output in tokens (default: the model's context length).", default=None
    )
    max_num_seqs: int = _opt("Most requests running in one step.", default=256)
    max_num_batched_tokens: int | None = _opt(
        "Token budget per step; long prompts are prefilled in chunks of at most this "
        "(default 512 on CPU, 2048 on CUDA).",
        default=None,
    )
    enable_chunked_prefill: bool = _opt(
        "Split long prompts across steps so running decodes never stall.", default=True
    )
    long_prefill_token_threshold: int | None = _opt(
        "With chunked prefill, the most prompt tokens one request prefills in a step: a long "
        "prompt then leaves room in every step for the prompts behind it, so short requests "
        "get their first token sooner (at the long one's expense). Default: no cap beyond the "
        "step's token budget.",
        default=None,
    )
    speculative: dict[str, Any] | str | None = _opt(
        "Speculative decoding: 'ngram', or JSON such as "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft", "quantization": "int4", "disable_by_batch_size": 3}\' '
        "(an int4 copy of the model as the draft, off in steps with more than 3 requests). "
        "Fields: docs/speculative.md.",
        default=None,
    )
    enable_jump_forward: bool = _opt(
        "Structured outputs: append the tokens a grammar forces next (JSON keys, punctuation) "
        "in one step instead of sampling them one step each. Requests that ask for logprobs "
        "never jump.",
        default=True,
    )
    lora_modules: dict[str, str] | None = _opt(
        "LoRA adapters to serve beside the base model: name=path[,name=path...] or a JSON "
        "object {\"name\": \"path\", ...}, or as vLLM takes them, several words each "
        "name=path or {\"name\": ..., \"path\": ..., \"base_model_name\": ...} (the "
        "base model name is ignored: there is one base model); each path is a PEFT adapter "
        "folder, hf://org/name[@revision] or "
        "s3://bucket/prefix (boto3's AWS credentials; AWS_ENDPOINT_URL for MinIO/R2). Requests "
        "pick one by name (the 'model' field over HTTP). See docs/lora.md.",
        default=None,
    )
    lora_modules_file: str | None = _opt(
        "A JSON file {\"name\": \"/adapter/folder\", ...} of LoRA adapters that the server "
        "re-reads every few seconds while it runs: adapters are loaded, replaced or unloaded "
        "to match it, without a restart (the operator mounts one from a ConfigMap). A broken "
        "entry is logged and skipped. See docs/lora.md.",
        default=None,
    )
    max_loras: int | None = _opt(
        "Most distinct LoRA adapters in one engine step (vLLM's --max-loras). Every adapter "
        "in a step costs its own gather, scatter and two small matmuls per projection; a "
        "waiting request whose adapter would be one too many waits (keeping its place in "
        "line) until a running adapter's requests finish, while requests behind it on the "
        "base model or on an adapter already running go ahead. Running requests are never "
        "preempted for it. At least 1; unset (None): no cap.",
        default=None,
    )
    max_loaded_loras: int | None = _opt(
        "Most LoRA adapters held in memory at once (vLLM's --max-cpu-loras, also accepted). "
        "Unset (None): every adapter is loaded when it is registered. Set: registering an "
        "adapter (--lora-modules, the modules file, /v1/load_lora_adapter) checks its config "
        "without reading weights, the first request naming it loads it, and loading one more "
        "evicts the least recently used adapter no request uses (when all are in use, the "
        "request waits). At least 1, and at least --max-loras. See docs/lora.md.",
        aliases=("--max-cpu-loras",),
        default=None,
    )
    enable_lora: bool = _opt(
        "Accepted for vLLM compatibility and ignored: LoRA adapters are always served, "
        "with or without it (default: off, which changes nothing either).",
        default=False,
    )
    max_lora_rank: int | None = _opt(
        "Refuse LoRA adapters of a higher rank (r, or the largest of rank_pattern) when they "
        "are registered or loaded (vLLM's --max-lora-rank; default: no limit, where vLLM's is "
        "16).",
        default=None,
    )
    seed: int = _opt("Seed for requests that give none.", default=0)
    cpu_threads: int | None = _opt(
        "Threads for CPU math (default: the CPUs this process may use: the smallest of the "
        "core count, the affinity mask and the cgroup CPU limit, e.g. a Kubernetes CPU limit).",
        default=None,
    )
    enforce_eager: bool = _opt("Disable CUDA graphs (CUDA only).", default=False)
    tensor_parallel_size: int = _opt(
        "Split the model over this many ranks (vLLM's --tensor-parallel-size): CUDA devices "
        "cuda:0..N-1, or CPU processes sharing the CPU threads. Each rank holds 1/N of the "
        "attention heads (and their KV cache) and of the MLP columns; two all-reduces per "
        "layer. N must divide the attention heads, the KV heads and the MLP size. Not with "
        "LoRA, batch_invariant, GPTQ/AWQ checkpoints or the self-draft; CUDA graphs go off. "
        "See docs/engine.md.",
        aliases=("-tp",),
        default=1,
    )
    batch_invariant: bool = _opt(
        "Make each request's tokens and logprobs independent of the rest of the batch, bit "
        "for bit: the same answer alone or under load, however its prompt is chunked, after a "
        "prefix-cache hit or a preemption (slower: see docs/engine.md). CPU and bfloat16 "
        "only (int8/int4 weights included); anything else is refused at startup.",
        default=False,
    )

    def __post_init__(self) -> None:
        # Checked here too (not only in SchedulerConfig) so a bad flag fails before the model
        # loads.
        check_max_loras(self.max_loras)
        check_max_loaded_loras(self.max_loaded_loras, self.max_loras)
        check_engine_options(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one `--flag` per field (booleans get --x / --no-x)."""
        for f in dataclasses.fields(cls):
            flags = [_flag(f.name), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "")
            if "(default" not in help_text and "; default" not in help_text:
                help_text += " (default: %(default)s)"  # unless the help says it in words
            if f.type in ("bool", bool):
                parser.add_argument(
                    *flags, dest=f.name, action=argparse.BooleanOptionalAction,
                    default=f.default, help=help_text,
                )
                continue
            # vLLM's --lora-modules takes several words: `--lora-modules a=/x b=/y`.
            several = ({"nargs": "+", "action": _LoRAModulesAction}
                       if f.name == "lora_modules" else {})
            parser.add_argument(
                *flags, dest=f.name, type=_cli_type(f.name, str(f.type)),
                default=f.default, help=help_text, **several,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# Integer options: name -> (smallest value, what None means; None: None is refused).
_INT_OPTIONS: dict[str, tuple[int, str | None]] = {
    "quantization_group_size": (1, None),
    "kv_cache_memory": (1, "the default"),
    "max_model_len": (2, "the model's context length"),
    "max_num_seqs": (1, None),
    "max_num_batched_tokens": (1, "the default"),
    "long_prefill_token_threshold": (1, "no cap"),
    "cpu_threads": (1, "every CPU this process may use"),
    "tensor_parallel_size": (1, None),
    "max_lora_rank": (1, "no limit"),
}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


KV_CACHE_DTYPES = ("auto", "int8")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_engine_options(args: EngineArgs) -> None:
    """ValueError naming the option (and its flag) for a value of the wrong type or out of
    range. Run when EngineArgs is built, so `LLM(...)` and `argosy serve` refuse a bad value
    at once, before the model loads, instead of failing deep inside it (max_model_len=-5
    raised a torch RuntimeError from the rotary tables, block_size=0 a ZeroDivisionError,
    seed="x" a RuntimeError from torch.manual_seed) or silently ignoring it
    (max_num_batched_tokens=0 meant the default; enable_prefix_caching="no" meant on)."""
    memory = args.kv_cache_memory
    if isinstance(memory, str):  # "2GiB", as --kv-cache-memory takes it
        try:
            args.kv_cache_memory = parse_bytes(memory)
        except ValueError:
            raise ValueError("kv_cache_memory (--kv-cache-memory) must be a whole number of bytes "
                             f"such as 2GiB, 512MiB or 1e9; got {memory!r}") from None
    elif isinstance(memory, float) and memory.is_integer():  # 1e9 (worked before the check)
        args.kv_cache_memory = int(memory)
    for name, (lo, unset) in _INT_OPTIONS.items():
        value = getattr(args, name)
        if value is None and unset is not None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            also = f", or unset for {unset}" if unset is not None else ""
            raise ValueError(f"{name} ({_flag(name)}) must be an integer >= {lo}{also}; "
                             f"got {value!r}")
    # More OpenMP threads than CPUs never helps, and a huge count crashed the process in
    # the first matrix multiply (--cpu-threads 100000: a segfault inside torch).
    cpus = os.cpu_count() or 1
    if args.cpu_threads is not None and args.cpu_threads > cpus:
        raise ValueError(f"cpu_threads (--cpu-threads) must be at most {cpus}, the CPUs of "
                         f"this machine; got {args.cpu_threads}")
    if args.block_size not in BLOCK_SIZES or isinstance(args.block_size, bool):
        raise ValueError(f"block_size (--block-size) must be a power of two in [1, 128], "
                         f"got {args.block_size!r}")
    if (isinstance(args.seed, bool) or not isinstance(args.seed, int)
            or not -(1 << 63) <= args.seed < (1 << 64)):
        raise ValueError(f"seed (--seed) must be a 64-bit integer, got {args.seed!r}")
    fraction = args.kv_cache_memory_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
            or not 0 < fraction <= 1):
        raise ValueError("kv_cache_memory_fraction (--kv-cache-memory-fraction) must be a "
                         f"number in (0, 1], got {fraction!r}")
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{f.name} must be True or False, got {value!r}")
    if args.served_model_name is not None and (
            not isinstance(args.served_model_name, str) or not args.served_model_name.strip()):
        raise ValueError("served_model_name (--served-model-name) must be a non-empty name, "
                         f"or unset for the --model value; got {args.served_model_name!r}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of "
                         f"{', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    # The engine's own checks, run here too so that the error names the flag. Imported here,
    # as the configs below: they import torch, which the CLI's parser must not.
    from argosy_runtime.config import resolve_device, resolve_dtype

    for name, resolve in (("dtype", resolve_dtype), ("device", resolve_device)):
        try:
            resolve(getattr(args, name))
        except ValueError as exc:
            raise ValueError(f"{name} ({_flag(name)}): {exc}") from None
    if args.quantization is not None:
        # Imported here: the quantization package imports torch, which the CLI's parser
        # (and `argosy gateway`) must not.
        from argosy_runtime.quantization.config import QuantizationConfig

        # The engine builds this config only once the checkpoint is open: an int4 group size
        # it cannot take was reported then, as a model that "cannot load".
        try:
            QuantizationConfig(method=args.quantization, group_size=args.quantization_group_size)
        except ValueError as exc:
            raise ValueError(f"quantization (--quantization, --quantization-group-size): "
                             f"{exc}") from None
    if args.speculative is not None:
        # Checked now, not when the engine builds its proposer after loading the model and
        # the KV cache: a bad --speculative otherwise failed only minutes later on a large
        # model. Imported here for the same reason as the quantization package above.
        from argosy_runtime.spec_decode.config import SpeculativeConfig

        try:
            SpeculativeConfig.from_user(args.speculative)
        except ValueError as exc:
            raise ValueError(f"speculative (--speculative): {exc}") from None


def _is_cap(value: object) -> bool:
    """None (no cap) or an int >= 1 (bool excluded)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 1)


def check_max_loras(value: object) -> None:
    """ValueError unless `value` is None (no cap) or an int >= 1."""
    if not _is_cap(value):
        raise ValueError(f"max_loras (--max-loras) must be an integer >= 1, or unset for no "
                         f"cap; got {value!r}")


def check_max_loaded_loras(value: object, max_loras: int | None = None) -> None:
    """ValueError unless `value` is None (no cap) or an int >= 1 and >= `max_loras`: a step
    runs up to max_loras adapters, each of which must be loaded."""
    if not _is_cap(value):
        raise ValueError("max_loaded_loras (--max-loaded-loras, --max-cpu-loras) must be an "
                         f"integer >= 1, or unset to load every adapter; got {value!r}")
    if value is not None and max_loras is not None and max_loras > value:
        raise ValueError(f"max_loras (--max-loras, {max_loras}) must be <= max_loaded_loras "
                         f"(--max-loaded-loras, {value}): a step runs only loaded adapters")


def _cli_type(name: str, type_str: str) -> Any:
    if name == "speculative":
        return _parse_speculative
    if name == "lora_modules":
        return parse_lora_modules
    if name == "hf_overrides":
        return parse_json_object
    if name == "kv_cache_memory":
        return parse_bytes_arg
    if type_str.startswith("int"):
        return int
    if type_str.startswith("float"):
        return float
    return str


def _parse_speculative(value: str) -> dict[str, Any] | str:
    value = value.strip()
    if value.startswith("{"):
        return parse_json_object(value)  # its message, not "invalid _parse_speculative value"
    return value


def parse_json_object(value: str) -> dict[str, Any]:
    """'{"key": value, ...}' -> dict; anything else is an argparse error."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {value!r}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


# vLLM's JSON form of one adapter: {"name": ..., "path": ..., "base_model_name": ...}.
_VLLM_LORA_FIELDS = frozenset({"name", "path", "base_model_name"})


def parse_lora_modules(value: str) -> dict[str, str]:
    """'a=/adapters/a,b=/adapters/b', '{"a": "/adapters/a"}' or vLLM's
    '{"name": "a", "path": "/adapters/a"}' -> {name: path}."""
    value = value.strip()
    if value.startswith("{"):
        modules = parse_json_object(value)  # its message, not "invalid parse_lora_modules value"
        if modules and modules.keys() <= _VLLM_LORA_FIELDS:
            # Read as {name: path} it served adapters called "name" and "path".
            modules = _vllm_lora_module(modules)
        for name, path in modules.items():
            # {"a": 1} or {"a": null} loaded the folder "1" or "None" once the model was loaded
            if not name or not isinstance(path, str) or not path:
                raise argparse.ArgumentTypeError(
                    f"expected {{\"name\": \"/adapter/path\", ...}}, got {name!r}: {path!r}")
        return modules
    modules = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path, got {item!r}")
        if name in modules:  # the later path silently replaced the earlier adapter
            raise argparse.ArgumentTypeError(f"adapter {name!r} is named twice")
        modules[name] = path
    return modules


def _vllm_lora_module(item: dict[str, Any]) -> dict[str, str]:
    """vLLM's {"name", "path", "base_model_name"} -> {name: path}. base_model_name is
    ignored, as vLLM ignores one that is not a served model: it only sets the adapter's
    `parent` in /v1/models, which here is always the one base model."""
    name, path = item.get("name"), item.get("path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(
            f"expected {{\"name\": \"...\", \"path\": \"...\"}} with both set, got "
            f"{json.dumps(item)}")
    return {name: path}


class _LoRAModulesAction(argparse.Action):
    """Merges the words of `--lora-modules a=/x b=/y` (each parsed by parse_lora_modules)
    into one {name: path}."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        merged: dict[str, str] = {}
        for modules in values:
            for name in modules:
                if name in merged:
                    parser.error(f"argument {option_string}: adapter {name!r} is named twice")
            merged.update(modules)
        setattr(namespace, self.dest, merged)


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MiB', '1e9' or a plain integer -> bytes; ValueError for anything else."""
    if isinstance(value, int):
        return value
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    scale = 1
    for suffix, unit in units.items():
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], unit
            break
    number = float(text) * scale
    # float() takes "inf" and "nan": int() of inf is an OverflowError, which argparse does
    # not turn into a usage error (a traceback), and no byte count is infinite anyway.
    if not math.isfinite(number):
        raise ValueError(f"not a finite number of bytes: {value!r}")
    if number != int(number):  # "1.5" (GiB meant?) was 1 byte, "0.5" 0 bytes
        raise ValueError(f"not a whole number of bytes: {value!r} (give a unit: 1.5GiB)")
    return int(number)


def parse_bytes_arg(value: str) -> int:
    """parse_bytes as an argparse type: the error names the flag and says what it takes
    (argparse's own message for a ValueError is "invalid parse_bytes value")."""
    try:
        return parse_bytes(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of bytes such as 2GiB, 1.5GiB, 512MiB or 1e9, got "
            f"{value!r}") from None
