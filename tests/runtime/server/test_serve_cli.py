"""`argosy serve` flags: every engine option is reachable, server options are validated."""

from __future__ import annotations

import dataclasses

import pytest
from argosy_runtime.cli.main import build_parser, main
from argosy_runtime.engine_args import EngineArgs
from argosy_runtime.server.config import ServerConfig


def test_every_engine_option_is_a_serve_flag() -> None:
    args = build_parser().parse_args([
        "serve", "--model", "m", "--served-model-name", "n", "--max-num-seqs", "4",
        "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching", "--port", "9001",
        "--max-waiting", "3", "--drain-timeout", "7", "--api-key", "k"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.served_model_name) == ("m", "n")
    assert engine_args.max_num_seqs == 4 and engine_args.kv_cache_memory == 1 << 30
    assert engine_args.enable_prefix_caching is False
    assert (args.port, args.max_waiting, args.drain_timeout, args.api_key) == (9001, 3, 7.0, "k")
    for f in dataclasses.fields(EngineArgs):
        assert hasattr(args, f.name), f.name


@pytest.mark.parametrize("flags", [["--drain-timeout", "-1"], ["--max-waiting", "-2"],
                                   ["--request-timeout", "-5"], ["--port", "70000"],
                                   ["--max-request-body-size", "-1"]])
def test_bad_server_options_exit_2_before_loading(flags: list[str],
                                                  capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert flags[0].lstrip("-").replace("-", "_").replace("_size", "_bytes") in err


def test_max_request_body_size_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-request-body-size", "1MiB"])
    assert args.max_request_body_size == 1 << 20
    assert parser.parse_args(["serve"]).max_request_body_size == 16 << 20


def test_server_config_validation() -> None:
    with pytest.raises(ValueError, match="log_level"):
        ServerConfig(log_level="loud")
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="  ")


def serve_exit_code(flags: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """`argosy serve FLAGS`'s exit code, failing the test if it got as far as loading the
    model (serve() is stubbed out: these flags must be refused before it)."""
    import argosy_runtime.cli.serve as serve_cli

    def loads(*_: object) -> int:
        pytest.fail(f"argosy serve {' '.join(flags)} was accepted and went on to load the model")

    monkeypatch.setattr(serve_cli, "serve", loads)
    try:
        return main(["serve", "--port", "0", *flags])
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.mark.parametrize("flags,words", [
    # OverflowError traceback from int(float("inf")) in parse_bytes
    (["--kv-cache-memory", "inf"], ["--kv-cache-memory", "inf"]),
    (["--max-request-body-size", "inf"], ["--max-request-body-size", "inf"]),
    # a fraction of a byte was truncated: "0.5" refused as "got 0", "1.5" (meant GiB?) taken
    # as 1 byte and refused only after the model loaded
    (["--kv-cache-memory", "1.5"], ["--kv-cache-memory", "1.5", "GiB"]),
    # NaN compares false with everything, so it passed the ">= 0" checks: every request
    # then timed out at once (408), and SIGTERM aborted running requests without waiting.
    (["--request-timeout", "nan"], ["request_timeout", "nan"]),
    (["--drain-timeout", "nan"], ["drain_timeout", "nan"]),
    # Checked only once the model and the KV cache were loaded (exit 2 after minutes on a
    # large model) ...
    (["--speculative", '{"num_speculative_tokens": 0}'], ["--speculative",
                                                          "num_speculative_tokens"]),
    (["--speculative", "eagle"], ["--speculative", "eagle"]),
    # ... or then a TypeError traceback ('<=' between int and str) ...
    (["--speculative", '{"num_speculative_tokens": "4"}'], ["--speculative",
                                                            "num_speculative_tokens"]),
    # ... or accepted, a float where steps need an int
    (["--speculative", '{"num_speculative_tokens": 2.5}'], ["--speculative",
                                                            "num_speculative_tokens"]),
    # argparse's "invalid _parse_speculative value", which says nothing of JSON
    (["--speculative", '{"method": ngram}'], ["--speculative", "JSON"]),
    (["--lora-modules", '{"a": "/x",'], ["--lora-modules", "JSON"]),
    # an adapter path that is not a string: accepted, failed once the model had loaded
    (["--lora-modules", '{"a": 1}'], ["--lora-modules", "a"]),
    # refused as "cannot load the model: dtype must be ...", naming no flag, after the imports
    (["--dtype", "fp32"], ["--dtype", "fp32"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8"]),
    # checked only once the checkpoint was open, as "cannot load the model: ... group_size"
    (["--quantization", "int4", "--quantization-group-size", "100"],
     ["--quantization-group-size", "100"]),
    # the same name twice: the first adapter was dropped without a word
    (["--lora-modules", "a=/x,b=/y,a=/z"], ["--lora-modules", "'a'", "twice"]),
    # silently no authentication ("--api-key $KEY" with KEY unset), while " " is refused
    (["--api-key", ""], ["--api-key"]),
])
def test_bad_flag_values_exit_2_naming_the_flag(flags: list[str], words: list[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    assert serve_exit_code(flags, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_blank_api_key_env_exits_2_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    # "  " used to reach ServerConfig, whose "api_key must not be empty" named no variable
    monkeypatch.setenv("ARGOSY_API_KEY", "  ")
    assert serve_exit_code([], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "ARGOSY_API_KEY" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="ARGOSY_API_KEY"):
        ServerConfig.api_key_from_env(None)
    # a flag still wins over the blank variable; an empty variable still means no key
    assert ServerConfig.api_key_from_env("k") == "k"
    monkeypatch.setenv("ARGOSY_API_KEY", "")
    assert ServerConfig.api_key_from_env(None) is None


def test_bad_speculative_config_is_refused_when_engine_args_are_built() -> None:
    # LLM(...) / LLMEngine(...) too: before the model loads, as a ValueError, not a TypeError
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative={"num_speculative_tokens": "4"})
    with pytest.raises(ValueError, match="min_acceptance_rate"):
        EngineArgs(speculative={"method": "ngram", "min_acceptance_rate": None})
    assert EngineArgs(speculative="ngram").speculative == "ngram"
    assert EngineArgs(speculative={"method": "draft", "quantization": "int4"}).speculative


def test_kv_cache_memory_help_states_the_real_cpu_default() -> None:
    from argosy_runtime.engine import _CPU_DEFAULT_KV_CACHE_MEMORY

    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineArgs)}
    # said "2 GiB on CPU" while the engine gives the cache 1 GiB
    assert f"{_CPU_DEFAULT_KV_CACHE_MEMORY >> 30} GiB on CPU" in help_text["kv_cache_memory"]


@pytest.mark.parametrize("flags", [["--request-timeout", "inf"], ["--drain-timeout", "inf"],
                                   ["--kv-cache-memory", "1e9"], ["--lora-modules", ""]])
def test_unusual_but_valid_flag_values_are_accepted(flags: list[str]) -> None:
    # inf: no limit, as asyncio takes it; "" for --lora-modules: no adapters
    args = build_parser().parse_args(["serve", *flags])
    EngineArgs.from_cli_args(args)
    ServerConfig(request_timeout=args.request_timeout, drain_timeout=args.drain_timeout)


# `argosy serve ARGV[1:]` whose model takes "forever" to load (a large model on a slow disk).
SLOW_LOADING_SERVE = """
import sys, time
from argosy_runtime.engine import LLMEngine
from argosy_runtime.cli.main import main

def slow_load(cls, engine_args):
    print("loading the model", flush=True)
    time.sleep(600)

LLMEngine.from_engine_args = classmethod(slow_load)
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_model_loads_exits_130_in_one_line(tmp_path) -> None:
    """SIGINT before the server runs (uvicorn's drain handler is not installed yet) was a
    KeyboardInterrupt traceback, then the interpreter waited for the loading thread and
    aborted ("terminate called without an active exception", SIGABRT)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_LOADING_SERVE, "serve", "--port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 120  # importing torch on a loaded machine
            while "loading the model" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert code == 130, (code, text)
    assert "Traceback" not in text and "terminate called" not in text, text
    assert "argosy serve: interrupted while starting" in text, text
