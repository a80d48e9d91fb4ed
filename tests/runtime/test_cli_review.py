"""User mistakes on `argosy gateway`, `argosy bench` and `argosy operator` get one line
naming what is wrong and exit code 2, not a traceback. In-process through `main(argv)`, with
the long-running part stubbed out, so that a regression starts nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from argosy_runtime.cli.main import main


@pytest.fixture
def no_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    import argosy_runtime.gateway.proxy.app as app

    def starts(*args: object) -> None:
        pytest.fail("the gateway started")

    monkeypatch.setattr(app, "run_gateway", starts)


def test_gateway_on_a_port_in_use_is_one_line(no_gateway: None,
                                              capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        # was an OSError traceback from asyncio's create_server, exit 1
        code = main(["gateway", "--backend", "m=http://127.0.0.1:1", "--port", port])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "argosy gateway: error:" in err and "--port " + port in err and "in use" in err, err


def test_gateway_on_a_host_that_does_not_resolve_is_one_line(
        no_gateway: None, capsys: pytest.CaptureFixture) -> None:
    # was a socket.gaierror traceback, exit 1
    code = main(["gateway", "--backend", "m=http://127.0.0.1:1", "--host", "not a host"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "argosy gateway: error:" in err and "--host 'not a host'" in err, err


def test_bench_serve_compare_of_a_missing_file_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing.json"
    # was a FileNotFoundError traceback, exit 1
    assert main(["bench", "serve", "--compare", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "argosy bench serve: error:" in err and str(missing) in err, err


@pytest.mark.parametrize("url", ["notaurl", "https://0.0.0.0:8080/healthz",
                                 "http://0.0.0.0:99999/healthz"])
def test_operator_liveness_url_is_checked_before_start(
        url: str, capsys: pytest.CaptureFixture) -> None:
    # kopf serves only http: was "Exception: Unsupported scheme" (or a port ValueError)
    # traceback from kopf's health reporter once the operator had started, exit 1.
    with pytest.raises(SystemExit) as exc:
        main(["operator", "--liveness", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--liveness" in err and url in err, err


def test_operator_liveness_url_of_the_docs_is_accepted() -> None:
    from argosy_runtime.cli.main import build_parser
    from argosy_runtime.cli.operator_cmd import kopf_argv

    args = build_parser().parse_args(["operator", "--liveness", "http://0.0.0.0:8080/healthz"])
    assert "--liveness=http://0.0.0.0:8080/healthz" in kopf_argv(args)
