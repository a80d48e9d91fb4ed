"""Malformed PEFT adapter folders: every one is a ValueError naming the adapter (what the
server answers as a 400, and the modules file logs and skips), never another exception (a 500,
a server that does not start, a modules file that stops applying its other entries). Real
adapters saved by PEFT into tmp folders, then broken one way each."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLMEngine, SamplingParams
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.lora.registry import check_registrable
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from engine_helpers import assert_no_leaks, run_requests  # noqa: E402
from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402

PROMPT = [5, 100, 2000, 300, 45, 999, 17, 4242]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def good(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("adapters") / "good", 1, r=4,
                             lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _patch_config(**changes) -> Callable[[Path], None]:  # noqa: ANN003
    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(data)


def _flatten_a(folder: Path) -> None:
    """Every lora_A saved 1-D (its first row): a tensor of the wrong rank, not a wrong size."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v[0].contiguous() if "lora_A" in k else v for k, v in tensors.items()},
              str(path))


def _map_weights(change: Callable[[str, torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    """Every tensor of the adapter's safetensors replaced by change(key, tensor)."""
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = folder / "adapter_model.safetensors"
        save_file({k: change(k, v) for k, v in load_file(str(path)).items()}, str(path))
    return edit


BROKEN = {
    "config-a-list": (_write("adapter_config.json", b"[1, 2]"), "not a JSON object"),
    "config-null": (_write("adapter_config.json", b"null"), "not a JSON object"),
    "config-not-json": (_write("adapter_config.json", b"{r: 4"), "cannot read"),
    "config-not-utf8": (_write("adapter_config.json", b'{"r": 4, "x": "\xff"}'), "cannot read"),
    # a RecursionError out of json: a traceback at start-up, a 500 over HTTP
    "config-nested": (_write("adapter_config.json", b"[" * 100_000 + b"]" * 100_000),
                      "nested too deeply"),
    "r-null": (_patch_config(r=None), "'r' must be a positive integer"),
    "r-zero": (_patch_config(r=0), "'r' must be a positive integer"),
    "r-zero-rslora": (_patch_config(r=0, use_rslora=True), "'r' must be a positive integer"),
    "r-negative": (_patch_config(r=-4), "'r' must be a positive integer"),
    "r-text": (_patch_config(r="four"), "'r' must be a positive integer"),
    "r-fraction": (_patch_config(r=4.5), "'r' must be a positive integer"),
    "alpha-null": (_patch_config(lora_alpha=None), "'lora_alpha' must be a number"),
    "alpha-text": (_patch_config(lora_alpha="8"), "'lora_alpha' must be a number"),
    "weights-garbage": (_write("adapter_model.safetensors", b"not safetensors" * 8),
                        "cannot read .*adapter_model.safetensors"),
    "weights-empty": (_write("adapter_model.safetensors", b""),
                      "cannot read .*adapter_model.safetensors"),
    "a-one-dimensional": (_flatten_a, "has shapes"),
    # loaded without complaint before: NaN weights turned every answer into empty text, and
    # integer ones failed in the first matmul
    "weights-nan": (_map_weights(lambda k, v: v.fill_(float("nan")) if "lora_B" in k else v),
                    "not finite"),
    "weights-int": (_map_weights(lambda k, v: v.to(torch.int32)), "int32"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_malformed_adapter_is_a_value_error_naming_it(model_dir, good, tmp_path,
                                                        case) -> None:  # noqa: ANN001
    edit, message = BROKEN[case]
    folder = tmp_path / case
    shutil.copytree(good, folder)
    edit(folder)
    spec = load_checkpoint(str(model_dir)).spec
    with pytest.raises(ValueError, match=f"^LoRA adapter 'bad': .*{message}"):
        LoRAAdapter.load("bad", folder, spec, torch.float32)


@pytest.mark.parametrize("case", [c for c in BROKEN if c.startswith(("config", "r-", "alpha"))])
def test_a_malformed_config_is_refused_at_lazy_registration(good, tmp_path, case) -> None:
    """With --max-loaded-loras the config is all registration reads: a bad one is refused
    there, not registered to fail every request naming it."""
    edit, message = BROKEN[case]
    folder = tmp_path / case
    shutil.copytree(good, folder)
    edit(folder)
    with pytest.raises(ValueError, match=f"^LoRA adapter 'bad': .*{message}"):
        check_registrable("bad", str(folder))


def test_adapters_that_load_still_do(model_dir, good, tmp_path) -> None:
    """What PEFT accepts stays accepted: lora_alpha 0 (a no-op adapter), a float16 adapter on
    a float32 base (converted), "r": 4.0, no lora_alpha at all (PEFT's default 8, see
    test_an_adapter_config_without_lora_alpha_scales_as_peft)."""
    spec = load_checkpoint(str(model_dir)).spec
    # alpha0: scale 1, its Bs carry the module scale 0 (folded in since alpha_pattern with
    # lora_alpha 0 is served: test_lora_review_serving.py)
    for name, edit, scale in [("alpha0", _patch_config(lora_alpha=0), 1.0),
                              ("r-float", _patch_config(r=4.0), 2.0),
                              ("no-alpha", _drop_alpha, 2.0),
                              ("fp16", _to_float16, 2.0)]:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        edit(folder)
        check_registrable(name, str(folder))
        adapter = LoRAAdapter.load(name, folder, spec, torch.float32)
        assert (adapter.rank, adapter.scale) == (4, scale), name
        assert adapter.layers[0]["qkv_proj"].a.dtype == torch.float32
        if name == "alpha0":  # still a no-op
            assert not adapter.layers[0]["qkv_proj"].b.any()


def _drop_alpha(folder: Path) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    del config["lora_alpha"]
    path.write_text(json.dumps(config))


def test_an_adapter_config_without_lora_alpha_scales_as_peft(model_dir, good, tmp_path) -> None:  # noqa: ANN001
    """An adapter_config.json with no lora_alpha (written by hand or another tool): PEFT takes
    LoraConfig's default alpha, 8, not r. Argosy took r (scale 1 instead of 8 / r) and its
    tokens differed from PEFT's for any r but 8."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "no-alpha"
    shutil.copytree(good, folder)  # r=4, lora_alpha=8 as saved
    _drop_alpha(folder)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
        str(folder)).eval()
    with torch.no_grad():
        expected = peft.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                 min_new_tokens=12)[0, len(PROMPT):].tolist()
    engine = LLMEngine(model=str(model_dir), dtype="float32", lora_modules={"a": str(folder)})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (out,) = run_requests(engine, [(PROMPT, params)], ["a"])
    assert out.outputs[0].token_ids == expected
    assert_no_leaks(engine)


def _to_float16(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(path)).items()}, str(path))


def test_a_broken_modules_file_entry_leaves_the_rest_served(model_dir, good,
                                                            tmp_path) -> None:
    """An entry whose config is not an object used to raise AttributeError out of `sync`:
    the engine did not start, and (while serving) the entries after it were never applied."""
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / "adapter_config.json").write_text("[]")
    modules = tmp_path / "adapters.json"
    modules.write_text(json.dumps({"broken": str(broken), "good": str(good)}))
    engine = LLMEngine(model=str(model_dir), dtype="float32", lora_modules_file=str(modules))
    assert set(engine.lora_paths) == {"good"}
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, temperature=0),
                       lora_name="good")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_an_unwritable_adapter_cache_is_a_value_error_naming_the_adapter(
        model_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """hf:// (and s3://) adapters are downloaded into $ARGOSY_LORA_CACHE; a cache folder that
    cannot be made (a read-only home in a container) raised a bare OSError: a 500 for each
    request with --max-loaded-loras. No network is reached: the folder comes first."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ARGOSY_LORA_CACHE", str(blocker / "cache"))
    spec = load_checkpoint(str(model_dir)).spec
    with pytest.raises(ValueError, match="^LoRA adapter 'hub': hf://org/adapter: cannot"):
        LoRAAdapter.load("hub", "hf://org/adapter", spec, torch.float32)
