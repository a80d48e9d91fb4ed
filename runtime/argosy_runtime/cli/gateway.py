"""`argosy gateway`: the OpenAI-compatible router in front of runtime replicas.

    argosy gateway --config gateway.yaml
    argosy gateway --backend smollm2-135m=http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8080

Flags override the file's host, port, drain timeout and default policy; `--backend` adds static routes.
See docs/gateway.md for the YAML schema. While the gateway runs, the file is re-read every few
seconds: its `tenants`, `routing` and the models' `policy` apply without a restart; other changes
need one.
Never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from argosy_runtime.log_levels import add_log_level_argument


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "gateway",
        help="Route OpenAI requests across replicas and models.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="Gateway YAML file (docs/gateway.md).")
    parser.add_argument("--host", help="Listen address (default 127.0.0.1).")
    parser.add_argument("--port", type=int, help="Listen port (default 8080).")
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="MODEL=URL[,URL...]",
        help="Static replicas of a model (repeatable).",
    )
    parser.add_argument(
        "--policy",
        choices=["round-robin", "least-load", "prefix-affinity"],
        help="Default routing policy (default prefix-affinity, falling back to least-load).",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="On SIGTERM, stop accepting connections and let answers in flight finish for at "
        "most this long before cutting them (default 30). In Kubernetes, put a preStop sleep "
        "in front and set terminationGracePeriodSeconds above both (docs/deploy.md).",
    )
    add_log_level_argument(parser)
    return parser


def build_config(args: argparse.Namespace, config_text: str | None = None):  # -> GatewayConfig
    """The GatewayConfig from `config_text` (the --config file's content, read by `load`;
    None: no file) plus flag overrides, validated once as a whole (a cascade in the file may
    name a model that only a --backend flag adds)."""
    import yaml

    from argosy_runtime.gateway.config import GatewayConfig, parse_backend_flag

    data: dict = {}
    if config_text is not None:
        data = yaml.safe_load(config_text) or {}
        if not isinstance(data, dict):
            raise ValueError("config: expected a mapping at the top level")
    if args.host is not None:
        data["host"] = args.host
    if args.port is not None:
        data["port"] = args.port
    if args.drain_timeout is not None:
        data["drain_timeout_s"] = args.drain_timeout
    if args.policy is not None:
        data["routing"] = {**(data.get("routing") or {}), "policy": args.policy}
    for flag in args.backend:
        model, urls = parse_backend_flag(flag)
        data["models"] = [*(data.get("models") or []), {"name": model, "backends": urls}]
    config = GatewayConfig.from_dict(data)
    if not config.models:
        raise ValueError("models: none configured (give --config or --backend)")
    return config


def load(args: argparse.Namespace):  # -> (GatewayConfig, ConfigFile | None)
    """The config to start with, and the file to re-read its `tenants` and `routing` from
    while running (None without --config). Both are built by `build_config` from the same flags, so a
    reloaded file is read exactly as the first one was."""
    from argosy_runtime.gateway.tenants.config_file import ConfigFile

    if not args.config:
        return build_config(args), None
    with open(args.config, encoding="utf-8") as f:
        text = f.read()
    config = build_config(args, text)
    return config, ConfigFile(args.config, text, config, lambda new: build_config(args, new))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import yaml

    from argosy_runtime.cli.serve import check_listen_address  # light: no torch
    from argosy_runtime.gateway.proxy.app import run_gateway

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config, config_file = load(args)
    except (OSError, ValueError) as exc:
        print(f"argosy gateway: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:  # not a ValueError: was a traceback
        print(f"argosy gateway: --config {args.config}: not valid YAML: "
              f"{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:  # a mistyped --host or a port in use: was an OSError traceback, exit 1
        check_listen_address(config.host, config.port)
    except ValueError as exc:
        print(f"argosy gateway: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C before run_gateway's handlers are in place (the listening socket not yet bound)
    # reaches main(): one line and 130, as every other argosy command.
    asyncio.run(run_gateway(config, config_file))
    return 0
