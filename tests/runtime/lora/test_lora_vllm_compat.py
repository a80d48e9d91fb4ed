"""What users moving from vLLM paste: its `--lora-modules` forms, `--enable-lora` and
`--max-lora-rank`, adapter folders holding only `adapter_model.bin`, and a bare Hub repo id.
Each works, or is refused with a one-line error naming the adapter or the flag. Real adapters
saved by PEFT."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch
from argosy_runtime import LLMEngine
from argosy_runtime.cli.main import build_parser
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.lora import LoRAAdapter
from argosy_runtime.lora.registry import LoRARegistry, check_registrable
from argosy_runtime.model_loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/runtime

from model_factory import make_peft_adapter, make_random_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("lora"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """small: r 4; big: r 4 but v_proj at rank 8 (rank_pattern)."""
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(model_dir, root / "small", 1, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    make_peft_adapter(model_dir, root / "big", 2, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8})
    return root


@pytest.fixture(scope="module")
def spec(model_dir: Path):  # noqa: ANN201
    return load_checkpoint(str(model_dir)).spec


def parse_serve(*flags: str):  # noqa: ANN201
    return build_parser().parse_args(["serve", *flags])


# ---- --lora-modules: vLLM's forms ---------------------------------------------------------

def test_lora_modules_takes_vllms_json_form_and_several_words() -> None:
    # Read before as three adapters called "name", "path" and "base_model_name".
    args = parse_serve("--lora-modules",
                       '{"name": "sql", "path": "/x", "base_model_name": "other"}')
    assert args.lora_modules == {"sql": "/x"}  # base_model_name: accepted and ignored
    # vLLM's several words, its two forms mixed; a word may still hold Argosy's list
    args = parse_serve("--lora-modules", "a=/a", '{"name": "b", "path": "/b"}', "c=/c,d=/d",
                       "--max-num-seqs", "2")
    assert args.lora_modules == {"a": "/a", "b": "/b", "c": "/c", "d": "/d"}
    assert EngineArgs.from_cli_args(args).lora_modules == args.lora_modules
    # Argosy's own JSON object is unchanged
    assert parse_serve("--lora-modules", '{"a": "/a", "b": "/b"}').lora_modules == {
        "a": "/a", "b": "/b"}


@pytest.mark.parametrize("words,message", [
    (['{"name": "sql"}'], "path"),
    (['{"path": "/x", "base_model_name": "m"}'], "name"),
    (['{"name": "sql", "path": ""}'], "path"),
    (['{"name": "sql", "path": "/x"'], "JSON"),
    (["a=/x", '{"name": "a", "path": "/y"}'], "'a' is named twice"),
])
def test_bad_lora_modules_is_a_one_line_error_naming_the_flag(
        words: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve("--lora-modules", *words)
    assert exc.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --lora-modules:" in error and message in error, error


# ---- --enable-lora and --max-lora-rank ----------------------------------------------------

def test_vllm_lora_flags_are_accepted() -> None:
    args = EngineArgs.from_cli_args(parse_serve(
        "--enable-lora", "--max-lora-rank", "64", "--max-loras", "2", "--max-cpu-loras", "4",
        "--lora-modules", "a=/a"))
    assert (args.enable_lora, args.max_lora_rank, args.max_loaded_loras) == (True, 64, 4)
    assert EngineArgs.from_cli_args(parse_serve()).max_lora_rank is None  # no limit
    with pytest.raises(ValueError, match=r"max_lora_rank \(--max-lora-rank\)"):
        EngineArgs(max_lora_rank=0)
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineArgs)}
    assert "ignored" in help_text["enable_lora"] and "16" in help_text["max_lora_rank"]


def test_max_lora_rank_refuses_a_larger_adapter_naming_it(spec, adapters: Path) -> None:  # noqa: ANN001
    big = adapters / "big"
    message = r"^LoRA adapter 'big': rank 8 .*--max-lora-rank\) 4"
    with pytest.raises(ValueError, match=message):  # rank_pattern's rank counts
        LoRAAdapter.load("big", big, spec, torch.float32, max_rank=4)
    with pytest.raises(ValueError, match=message):  # --max-loaded-loras registration
        check_registrable("big", str(big), max_rank=4)
    with pytest.raises(ValueError, match=message):
        LoRARegistry(lambda *_: pytest.fail("loaded"), 1, max_rank=4).register("big", str(big))
    assert LoRAAdapter.load("big", big, spec, torch.float32, max_rank=8).layers
    check_registrable("big", str(big), max_rank=8)


def test_max_lora_rank_reaches_the_engine(model_dir: Path, adapters: Path) -> None:
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       kv_cache_memory=1 << 20, max_lora_rank=4,
                       lora_modules={"small": str(adapters / "small")})
    assert set(engine.lora_adapters) == {"small"}
    # what POST /v1/load_lora_adapter calls: its ValueError is the 400
    with pytest.raises(ValueError, match="'big': rank 8 .*--max-lora-rank"):
        engine.load_lora_adapter("big", str(adapters / "big"))
    assert set(engine.lora_paths) == {"small"}


# ---- adapter_model.bin ---------------------------------------------------------------------

def _as_bin(folder: Path, out: Path) -> Path:
    """`folder` with its weights saved as older PEFT did: only adapter_model.bin."""
    from safetensors.torch import load_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    (out / "adapter_model.safetensors").unlink()
    torch.save(tensors, out / "adapter_model.bin")
    return out


def test_adapter_model_bin_loads_as_the_safetensors(spec, adapters: Path,  # noqa: ANN001
                                                    tmp_path: Path) -> None:
    folder = _as_bin(adapters / "big", tmp_path / "bin")
    check_registrable("a", str(folder))
    from_bin = LoRAAdapter.load("a", folder, spec, torch.float32)
    from_safetensors = LoRAAdapter.load("a", adapters / "big", spec, torch.float32)
    assert from_bin.layers.keys() == from_safetensors.layers.keys()
    for layer, modules in from_safetensors.layers.items():
        for module, weights in modules.items():
            assert torch.equal(from_bin.layers[layer][module].a, weights.a)
            assert torch.equal(from_bin.layers[layer][module].b, weights.b)


class _RunsCode:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("unpickling ran code",))


@pytest.mark.parametrize("content", ["code", "garbage", "not-a-state-dict"])
def test_an_unsafe_or_broken_bin_is_a_value_error_naming_the_adapter(
        spec, adapters: Path, tmp_path: Path, content: str,  # noqa: ANN001
        capsys: pytest.CaptureFixture) -> None:
    folder = _as_bin(adapters / "small", tmp_path / "bin")
    weights = folder / "adapter_model.bin"
    if content == "code":
        torch.save({"x.lora_A.weight": _RunsCode()}, weights)
    elif content == "garbage":
        weights.write_bytes(b"not a pickle" * 8)
    else:
        torch.save([torch.zeros(2, 2)], weights)
    with pytest.raises(ValueError, match=r"^LoRA adapter 'bad': (cannot read \S+adapter_model"
                                         r"\.bin as PyTorch|\S+adapter_model\.bin does not)"):
        LoRAAdapter.load("bad", folder, spec, torch.float32)
    assert "unpickling ran code" not in capsys.readouterr().out


# ---- unreadable weights ---------------------------------------------------------------------

def test_unreadable_weights_are_a_value_error_naming_adapter_and_file(
        model_dir: Path, adapters: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = shutil.copytree(adapters / "small", tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    engine = LLMEngine(model=str(model_dir), dtype="float32", block_size=4,
                       kv_cache_memory=1 << 20, max_loaded_loras=1,
                       lora_modules={"a": str(folder)})  # registered, loaded on first use
    # A file that stat() finds but read() refuses (mode 000 for a non-root server; tests run
    # as root, which chmod does not stop, so the read itself fails here).
    real_read_bytes = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path == weights:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a': cannot read .*adapter_model"
                                         r"\.safetensors: .*Permission denied"):
        engine.add_request("r", [1, 2, 3], lora_name="a")
    monkeypatch.undo()
    engine.add_request("r2", [1, 2, 3], lora_name="a")  # nothing kept: a later request loads
    assert set(engine.lora_adapters) == {"a"}


# ---- a bare Hub repo id ---------------------------------------------------------------------

def test_a_bare_hub_repo_id_says_to_write_hf(spec, tmp_path: Path,  # noqa: ANN001
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no folder "some-org" here
    hint = "some-org/sql-lora is not a local folder; for a Hugging Face Hub adapter write " \
           "hf://some-org/sql-lora"
    with pytest.raises(ValueError, match=f"^LoRA adapter 'sql': {hint}$"):
        LoRAAdapter.load("sql", "some-org/sql-lora", spec, torch.float32)
    with pytest.raises(ValueError, match=f"^LoRA adapter 'sql': {hint}$"):
        check_registrable("sql", "some-org/sql-lora")
    # a path that is no repo id keeps the folder message
    with pytest.raises(ValueError, match="needs adapter_config.json"):
        check_registrable("sql", str(tmp_path / "missing"))
