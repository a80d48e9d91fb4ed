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
