"""LoRA adapters in the engine against PEFT + transformers (float32, greedy): adapters and the
base model batched together, chunked prefill and preemption, prefix-cache isolation between
adapters, and clear errors for adapters that cannot be applied."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks, run_requests  # noqa: E402
from model_factory import QWEN3_TEST_SHAPE, make_peft_adapter, make_random_model_dir  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 100, 2000, 300, 45, 999, 17, 4242, 8, 31000, 77, 12] * 3,
           [9, 8, 7, 6, 5], [40000, 123, 456, 789] * 5]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_peft_adapter(model_dir, tmp / "all", 1, r=8, lora_alpha=24, target_modules=ALL),
        "attn-rs": make_peft_adapter(model_dir, tmp / "attn", 2, r=4, lora_alpha=8, use_rslora=True,
                                target_modules=["q_proj", "v_proj", "o_proj"]),
    }


@torch.no_grad()
def peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             min_new_tokens=MAX_TOKENS)  # ignore_eos, as the engine runs below
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def references(model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    refs = {name: peft_greedy(model_dir, path, PROMPTS) for name, path in adapters.items()}
    refs[None] = peft_greedy(model_dir, None, PROMPTS)
    assert refs["all"] != refs[None] and refs["attn-rs"] != refs[None]  # the adapters matter
    return refs


def run(engine: LLMEngine, jobs: list[tuple[str | None, int]]) -> list[list[int]]:
    """jobs: (adapter name or None, prompt index); all added at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = run_requests(engine, [(PROMPTS[p], params) for _, p in jobs],
                           [lora for lora, _ in jobs])
    return [out.outputs[0].token_ids for out in outputs]


def test_adapters_and_base_in_one_batch_equal_peft(model_dir, adapters, references) -> None:
    # Tiny prefill chunks and a pool small enough to preempt: adapter rows must follow their
    # requests through chunking, decode rows first reordering and recompute.
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       max_num_batched_tokens=10, kv_cache_memory=7 * 4 * 2 * 2 * 64 * 4,  # 14 blocks
                       lora_modules={k: str(v) for k, v in adapters.items()})
    jobs = [(lora, p) for p in range(len(PROMPTS)) for lora in ("all", None, "attn-rs")]
    outputs = run(engine, jobs)
    assert engine.get_stats().num_preemptions > 0
    for (lora, p), out in zip(jobs, outputs, strict=True):
        assert out == references[lora][p], (lora, p)
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch,shape", [("qwen2", {}), ("qwen3", QWEN3_TEST_SHAPE)],
                         ids=["qwen2-qkv-bias", "qwen3-qk-norm"])
def test_adapters_on_qwen_bases_equal_peft(arch, shape, tmp_path) -> None:  # noqa: ANN001
    """The LoRA deltas land where PEFT puts them on the other architectures too: beside
    Qwen2's q/k/v biases, and before Qwen3's per-head q/k norms (on a head_dim that is not
    hidden / heads, so the q/k/v shapes differ from the hidden size)."""
    model_dir = make_random_model_dir(tmp_path, arch, **shape)
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", 3, r=8, lora_alpha=16,
                           target_modules=ALL)
    prompts = PROMPTS[:2]
    base, lora = peft_greedy(model_dir, None, prompts), peft_greedy(model_dir, adapter, prompts)
    assert base != lora  # the adapter matters
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       max_num_batched_tokens=16, lora_modules={"a": str(adapter)})
    outputs = run(engine, [("a", 0), (None, 0), ("a", 1), (None, 1)])
    assert outputs == [lora[0], base[0], lora[1], base[1]]
    assert_no_leaks(engine)


def test_prefix_cache_never_crosses_adapters(model_dir, adapters, references) -> None:
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    # One after another, so each could hit the blocks the previous ones cached: only the
    # second run on the same adapter may (8 full blocks of the 36-token prompt).
    for i, lora in enumerate(("all", None, "attn-rs", "all")):
        hits_before = engine.get_stats().prefix_cache_hits
        assert run(engine, [(lora, 0)]) == [references[lora][0]], lora
        hits = engine.get_stats().prefix_cache_hits - hits_before
        assert hits == (32 if i == 3 else 0), (lora, hits)
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs", [{"dtype": "bfloat16"},  # C++ decode layers for base rows
                                    {"dtype": "float32", "quantization": "int8"}])
def test_adapters_on_bf16_and_quantized_bases(model_dir, adapters, kwargs) -> None:
    """No reference exists for these (PEFT runs float32 weights): the adapter changes the
    output, and a request's output does not depend on the base rows batched with it."""
    engine = LLMEngine(model=str(model_dir), lora_modules={"all": str(adapters["all"])},
                       **kwargs)
    base, with_lora = run(engine, [(None, 1), ("all", 1)])
    alone = run(engine, [("all", 1)])[0]
    assert with_lora != base and with_lora == alone
    assert_no_leaks(engine)


def test_unknown_adapter_is_a_value_error(model_dir, adapters) -> None:
    engine = LLMEngine(model=str(model_dir), dtype="float32",
                       lora_modules={"all": str(adapters["all"])})
    with pytest.raises(ValueError, match="lora_name: no LoRA adapter 'nope'; serving \\['all'\\]"):
        engine.add_request("x", [1, 2, 3], SamplingParams(), lora_name="nope")
    assert_no_leaks(engine)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "adapter_config.json").unlink(), "needs adapter_config.json"),
    (lambda d: _patch_config(d, use_dora=True), "unsupported .*use_dora"),
    (lambda d: _patch_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda d: _rename_keys(d, "q_proj", "embed_tokens"), "cannot apply"),
    (lambda d: _reshape_a(d), "has shapes"),
])
def test_adapters_that_cannot_apply_are_value_errors(model_dir, adapters, tmp_path, edit,
                                                     message) -> None:
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(adapters["all"], folder)
    edit(folder)
    spec = load_checkpoint(str(model_dir)).spec
    with pytest.raises(ValueError, match=message):
        LoRAAdapter.load("bad", folder, spec, torch.float32)


def _patch_config(folder: Path, **changes) -> None:  # noqa: ANN003
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rename_keys(folder: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k.replace(old, new): v for k, v in load_file(str(path)).items()}, str(path))


def _reshape_a(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path))


def test_adapters_load_and_unload_while_requests_run(model_dir, adapters, references,
                                                     tmp_path) -> None:
    """Loading and unloading between steps: requests already running keep their adapter;
    an adapter retrained in place and loaded again gets none of the old one's cached blocks."""
    import shutil

    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("base", PROMPTS[0], params)
    engine.step()
    folder = tmp_path / "tuned"
    shutil.copytree(adapters["all"], folder)
    engine.load_lora_adapter("tuned", str(folder))
    engine.add_request("a", PROMPTS[0], params, lora_name="tuned")
    engine.step()
    engine.unload_lora_adapter("tuned")  # "a" is running on it: it finishes on it
    with pytest.raises(ValueError, match="no LoRA adapter 'tuned'"):
        engine.add_request("b", PROMPTS[0], params, lora_name="tuned")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done == {"base": references[None][0], "a": references["all"][0]}
    with pytest.raises(KeyError):
        engine.unload_lora_adapter("tuned")
    # Retrained in place: same name, same folder, other weights.
    shutil.rmtree(folder)
    shutil.copytree(adapters["attn-rs"], folder)
    engine.load_lora_adapter("tuned", str(folder))
    hits_before = engine.get_stats().prefix_cache_hits
    assert run(engine, [("tuned", 0)]) == [references["attn-rs"][0]]
    assert engine.get_stats().prefix_cache_hits == hits_before
    # the base model's name; blank; a NUL or newline (a Prometheus label value and a `model`
    # in /v1/models: a NUL broke the metrics exposition); a name far past any model id
    for name in (engine.served_model_name, " ", "a\x00b", "a\nb", "x" * 257):
        with pytest.raises(ValueError, match="not a usable adapter name"):
            engine.load_lora_adapter(name, str(folder))
    served = set(engine.lora_paths)
    engine.load_lora_adapter("org/tuned-v2 (ünïcode)", str(folder))  # names as users write them
    assert set(engine.lora_paths) == served | {"org/tuned-v2 (ünïcode)"}
    assert_no_leaks(engine)


def test_lora_modules_file_keeps_the_engine_in_step(model_dir, adapters, references, tmp_path,
                                                    caplog) -> None:
    modules = tmp_path / "adapters.json"
    modules.write_text(json.dumps({"all": str(adapters["all"])}))
    engine = LLMEngine(model=str(model_dir), dtype="float32",
                       lora_modules={"fixed": str(adapters["attn-rs"])},
                       lora_modules_file=str(modules))
    watcher = engine.lora_modules_file
    assert set(engine.lora_adapters) == {"fixed", "all"}
    assert watcher.sync(engine) is False  # nothing changed
    # A new entry whose folder is not there yet: logged once, the rest applied, retried.
    late = tmp_path / "late"
    modules.write_text(json.dumps({"all": str(adapters["all"]), "late": str(late)}))
    with caplog.at_level("ERROR", logger="argosy.lora"):
        assert watcher.sync(engine) is False and watcher.sync(engine) is False
    assert len([r for r in caplog.records if "late" in r.getMessage()]) == 1
    import shutil

    shutil.copytree(adapters["attn-rs"], late)
    assert watcher.sync(engine) is True and set(engine.lora_adapters) == {"fixed", "all", "late"}
    assert run(engine, [("late", 1), ("all", 1)]) == [references["attn-rs"][1],
                                                     references["all"][1]]
    # A broken file changes nothing; removing entries unloads only what the file loaded.
    modules.write_text("{not json")
    assert watcher.sync(engine) is False and len(engine.lora_adapters) == 3
    modules.write_text(json.dumps({"fixed": str(adapters["attn-rs"])}))
    assert watcher.sync(engine) is True and set(engine.lora_adapters) == {"fixed"}
    modules.write_text("{}")
    assert watcher.sync(engine) is True and engine.lora_adapters == {}  # the file took "fixed"
    assert_no_leaks(engine)


def test_an_adapter_loaded_again_under_its_name_keeps_old_requests_on_the_old_weights(
        model_dir, adapters, references) -> None:
    """Reloading a name while its requests run puts two adapters of one name in a step:
    each request keeps its own weights (grouping the rows by name would mix them)."""
    engine = LLMEngine(model=str(model_dir), dtype="float32",
                       lora_modules={"x": str(adapters["all"])})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("old", PROMPTS[0], params, lora_name="x")
    engine.step()
    engine.load_lora_adapter("x", str(adapters["attn-rs"]))
    engine.add_request("new", PROMPTS[1], params, lora_name="x")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done == {"old": references["all"][0], "new": references["attn-rs"][1]}
    assert_no_leaks(engine)
