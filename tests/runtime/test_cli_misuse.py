"""Misusing the `argosy` command line gets a one-line error naming what is wrong and exit
code 2, never a Python traceback; options that need no model are refused before it loads.
Real processes, each a few seconds at most. (In-process checks of server options:
tests/runtime/server/test_serve_cli.py.)"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Port 0 ("any free port"): these commands must exit before listening, and must not fail
# only because port 8000 is taken on this machine.
SERVE = ["serve", "--port", "0"]


def argosy(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `argosy ARGS`; a command that does not exit in time (a server that started
    serving instead of refusing its options) fails the test."""
    try:
        return subprocess.run([sys.executable, "-m", "argosy_runtime.cli.main", *args],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"argosy {' '.join(args)} did not exit within {timeout}s")


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for word in words:
        assert word in proc.stderr, (word, proc.stderr[-2000:])


@pytest.mark.parametrize("flags,words", [
    # was a torch RuntimeError traceback from the rotary tables, after loading
    (["--max-model-len", "-5"], ["--max-model-len", "-5"]),
    # was silently the default budget: the server started serving
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens"]),
    (["--kv-cache-memory-fraction", "2"], ["--kv-cache-memory-fraction"]),  # was ignored
    (["--served-model-name", ""], ["--served-model-name"]),  # was silently the model name
    (["--block-size", "0"], ["--block-size"]),  # was a ZeroDivisionError, after loading
    (["--quantization", "fp8"], ["quantization", "fp8"]),  # was checked after loading
    # was uvicorn's "[Errno -2] Name or service not known", exit 3, after loading
    (["--host", "not a host"], ["--host", "not a host"]),
    # was an OverflowError traceback from the byte-size parser
    (["--kv-cache-memory", "inf"], ["--kv-cache-memory", "inf"]),
    # was a TypeError traceback, once the model had loaded
    (["--speculative", '{"num_speculative_tokens": "4"}'], ["--speculative",
                                                            "num_speculative_tokens"]),
])
def test_bad_serve_options_are_refused_before_loading(flags: list[str],
                                                      words: list[str]) -> None:
    # Refused before the model loads: a fraction of a second.
    assert_refused(argosy(*SERVE, *flags, timeout=30), "argosy serve: error:", *words)


def test_serve_on_a_port_in_use_is_refused_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = argosy("serve", "--port", port, timeout=30)
    # was uvicorn's "address already in use", exit 3, once the model had loaded
    assert_refused(proc, "argosy serve: error:", "--port", port, "in use")


@pytest.mark.parametrize("kind", ["missing", "empty folder"])
def test_serve_a_model_path_that_does_not_load(tmp_path: Path, kind: str) -> None:
    model = tmp_path / "nothing-here"
    if kind == "empty folder":
        model.mkdir()
    # was a FileNotFoundError traceback, exit 1
    assert_refused(argosy(*SERVE, "--model", str(model)), "cannot load the model", str(model))


@pytest.mark.parametrize("setup,flags,words", [
    ("none", ["missing.txt"], ["No such file", "missing.txt"]),
    ("text", ["text.txt", "--window", "1"], ["window"]),  # was a traceback after loading
    ("text", ["text.txt", "--max-tokens", "-1"], ["--max-tokens"]),  # was silently N - 1
    ("text", ["text.txt", "--model", "missing-model"], ["missing-model"]),
])
def test_bad_perplexity_arguments(tmp_path: Path, setup: str, flags: list[str],
                                  words: list[str]) -> None:
    if setup == "text":
        (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n")
    flags = [str(tmp_path / flags[0]), *flags[1:]]
    assert_refused(argosy("perplexity", *flags), "argosy perplexity: error:", *words)


@pytest.mark.parametrize("flags,words", [
    # was a ValueError traceback from int()
    (["offline", "--batch-sizes", "a,b"], ["argosy bench offline: error:", "--batch-sizes"]),
    # a misspelt peer was skipped without a word: the table lacked it
    (["offline", "--peers", "transformer"], ["--peers", "'transformer'", "vllm"]),
    # was an engine error once the model had loaded, naming no flag
    (["offline", "--input-len", "0"], ["--input-len", "'0'"]),
    # float's "could not convert string to float: 'fast'", naming no flag
    (["serve", "--rate", "4,fast"], ["argosy bench serve: error:", "--rate", "'fast'"]),
    # "num_prompts, input_len and output_len must be >= 1": which of the three?
    (["serve", "--num-prompts", "0"], ["--num-prompts", "'0'"]),
])
def test_bad_bench_option_is_one_line_naming_the_flag(flags: list[str],
                                                      words: list[str]) -> None:
    assert_refused(argosy("bench", *flags, "--json", "/nonexistent/unwritten.json",
                          timeout=30), *words)


@pytest.mark.parametrize("command,flags,words", [
    # logging.basicConfig's "ValueError: Unknown level: 'LOUD'" traceback, exit 1
    ("gateway", ["--log-level", "loud", "--backend", "m=http://127.0.0.1:1"],
     ["argosy gateway: error:", "--log-level", "loud"]),
    ("fleet", ["--log-level", "loud", "--replicas", "1"],
     ["argosy fleet: error:", "--log-level", "loud"]),
    ("serve", ["--log-level", "loud"], ["argosy serve: error:", "--log-level", "loud"]),
    # a yaml.YAMLError traceback (not a ValueError, so not caught), exit 1
    ("gateway", ["--config", "BAD_YAML"], ["argosy gateway:", "--config", "YAML", "line 2"]),
    ("fleet", ["--autoscaling", "{a: [b", "--min", "0", "--max", "1"],
     ["argosy fleet:", "--autoscaling", "YAML"]),
    ("autoscale-sim", ["--policy", "BAD_YAML", "--trace", "-"],
     ["argosy autoscale-sim:", "policy", "YAML", "line 2"]),
])
def test_bad_log_level_or_yaml_of_other_commands(tmp_path: Path, command: str,
                                                 flags: list[str], words: list[str]) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("a: [b\n")
    flags = [str(bad_yaml) if flag == "BAD_YAML" else flag for flag in flags]
    proc = argosy(command, *flags, timeout=30)
    assert_refused(proc, *words)
    last_line = proc.stderr.strip().splitlines()[-1]  # after argparse's usage, if any
    assert all(word in last_line for word in words), proc.stderr


@pytest.mark.parametrize("command", ["serve", "gateway", "fleet"])
def test_log_level_is_case_insensitive_for_every_command(command: str) -> None:
    # `argosy serve --log-level INFO` was refused while the gateway and fleet took it.
    from argosy_runtime.cli.main import build_parser

    args, _ = build_parser().parse_known_args([command, "--log-level", "WARNING"])
    assert args.log_level == "warning"


def test_fleet_autoscaling_without_min_and_max_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # The overrides apply only to an autoscaled fleet: without --min/--max they were silently
    # ignored (unknown fields too) and a fixed-size fleet started. In-process, with the fleet
    # itself stubbed out, so that a regression starts no replica.
    import argosy_runtime.fleet.supervisor as supervisor
    from argosy_runtime.cli.main import main

    def starts(config: object) -> None:
        pytest.fail(f"the fleet started: {config}")

    monkeypatch.setattr(supervisor, "Fleet", starts)
    assert main(["fleet", "--replicas", "1", "--autoscaling", "{targetQueueDepth: 2}"]) == 2
    err = capsys.readouterr().err
    assert "--autoscaling" in err and "--min" in err and "--max" in err, err


@pytest.mark.parametrize("flags,words", [
    # FleetConfig's field names ("replicas: must be...", "liveness_timeout: ...") named no
    # flag the user typed
    (["--replicas", "0"], ["--replicas", "got 0"]),
    (["--min", "2", "--max", "1"], ["--replicas", "min (2)", "max (1)"]),
    (["--liveness-timeout", "0.5"], ["--liveness-timeout", "0.5"]),
    (["--port", "99999"], ["--port", "99999"]),
    (["--min", "1"], ["--min/--max"]),
    (["--", "--port", "1"], ["the arguments after --", "--port"]),
])
def test_bad_fleet_options_name_the_flag(flags: list[str], words: list[str]) -> None:
    assert_refused(argosy("fleet", *flags, timeout=30), "argosy fleet: ", *words)
