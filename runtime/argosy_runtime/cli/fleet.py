"""`argosy fleet`: the whole stack on one machine, without Kubernetes.

    argosy fleet --model smollm2-135m --replicas 2 --port 8080
    argosy fleet --model smollm2-135m --replicas 1 --min 1 --max 3 --policy least-load
    argosy fleet --model smollm2-135m --min 0 --max 2 --autoscaling '{scaleToZeroIdleSeconds: 120}'

Starts N `argosy serve` processes on free loopback ports and the gateway on --port in front
of them. With --min and --max, the autoscaler's decision function (the one the operator runs
in a cluster) starts and drains replicas on KV-cache usage and queue depth; --autoscaling
takes a YAML/JSON mapping of further policy fields in the LLMDeployment's camelCase
(e.g. '{scrapeIntervalSeconds: 2, targetQueueDepth: 2}'). With --min 0 the fleet goes to zero
replicas after scaleToZeroIdleSeconds idle (default 600) and back up when a request comes:
the gateway holds it until the new replica is ready (--replicas 0 starts at zero). Arguments
after `--` go to every `argosy serve`. Ctrl-C or SIGTERM drains every replica and exits; a
second one kills the replicas instead of waiting for them to drain.
"""

from __future__ import annotations

import argparse
import sys

from argosy_runtime.log_levels import add_log_level_argument


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "fleet",
        help="Run N local replicas behind the gateway (optionally autoscaled).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m",
                        help="Model for every replica (default: %(default)s).")
    parser.add_argument("--served-model-name", help="Name clients use (default: --model).")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="Replicas to start (default 2; with --min, --min or at least 1).",
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="Gateway listen address (default: %(default)s).")
    parser.add_argument("--port", type=int, default=8080, help="Gateway port (default 8080).")
    parser.add_argument(
        "--policy",
        default="prefix-affinity",
        choices=["round-robin", "least-load", "prefix-affinity"],
        help="Routing policy (default prefix-affinity).",
    )
    parser.add_argument("--min", dest="min_replicas", type=int, help="Autoscale: fewest replicas.")
    parser.add_argument("--max", dest="max_replicas", type=int, help="Autoscale: most replicas.")
    parser.add_argument("--autoscaling", help="Autoscaling policy overrides (YAML mapping).")
    parser.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="Do not replace a replica process that exits on its own.",
    )
    parser.add_argument(
        "--liveness-timeout",
        dest="liveness_timeout_s",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="Kill and replace a ready replica whose /health has failed (an error status, or "
        "no answer within 5 s, or within this timeout if shorter) for this many seconds: a "
        "hung process or a dead engine (default %(default)g, as the operator's "
        "livenessProbe; 0: never; else at least 1).",
    )
    parser.add_argument("--log-dir", help="Where replica logs go (default: a temp folder).")
    add_log_level_argument(parser)
    parser.add_argument("serve_args", nargs="*", help="Arguments after -- for argosy serve.")
    return parser


def run(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import signal

    import yaml

    from argosy_runtime.cli.serve import check_listen_address  # light: no torch
    from argosy_runtime.fleet.supervisor import Fleet, fleet_config_from

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        try:
            overrides = yaml.safe_load(args.autoscaling) if args.autoscaling else {}
        except yaml.YAMLError as exc:  # not a ValueError: was a traceback
            raise ValueError(f"--autoscaling: not valid YAML: {' '.join(str(exc).split())}"
                             ) from None
        if not isinstance(overrides, dict):
            raise ValueError("--autoscaling: expected a mapping")
        if overrides and (args.min_replicas is None or args.max_replicas is None):
            # Only an autoscaled fleet reads them: they were silently ignored (unknown
            # fields included) and a fixed-size fleet started.
            raise ValueError("--autoscaling needs --min and --max (it tunes the autoscaler)")
        config = fleet_config_from(
            model=args.model,
            served_model_name=args.served_model_name,
            replicas=args.replicas if args.replicas is not None else _default_replicas(args),
            host=args.host,
            port=args.port,
            policy=args.policy,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            autoscaling=overrides,
            serve_args=tuple(args.serve_args),
            log_dir=args.log_dir,
            restart=args.restart,
            liveness_timeout_s=args.liveness_timeout_s,
        )
    except ValueError as exc:
        print(f"argosy fleet: {_name_the_flag(str(exc))}", file=sys.stderr)
        return 2
    try:  # a port in use is the user's to change: exit 2 like serve and gateway, not 1
        check_listen_address(config.host, config.port)
    except ValueError as exc:
        print(f"argosy fleet: error: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        fleet = Fleet(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        received: list[int] = []

        def on_signal(signum: int) -> None:
            if stop.is_set():  # a second Ctrl-C: stop waiting for the replicas to drain
                print("argosy fleet: killing the replicas", file=sys.stderr, flush=True)
                fleet.kill()
            received.append(signum)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        # Loading the replicas can take minutes: a signal meanwhile stops the start-up (which
        # drains what it started when cancelled) instead of waiting for it to finish.
        starting = asyncio.ensure_future(fleet.start())
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            # The fleet never served: not a success. 128 + the signal, as a shell reports a
            # command the signal stopped (130 for Ctrl-C), as `argosy serve` exits.
            print("argosy fleet: interrupted while starting", file=sys.stderr, flush=True)
            return 128 + received[0]
        signalled.cancel()
        try:
            url = starting.result()
        except RuntimeError as exc:
            print(f"argosy fleet: {exc}", file=sys.stderr)
            return 1
        for proc in fleet.processes:
            pid = proc.process.pid if proc.process else None
            print(f"argosy fleet: replica {proc.url} (pid {pid})", flush=True)
        print(f"argosy fleet: {len(fleet.processes)} x {config.name} behind {url} "
              f"(replica logs in {fleet.log_dir})", flush=True)
        try:
            await stop.wait()
        finally:
            await fleet.stop()
        return 0

    return asyncio.run(main())


# FleetConfig's errors start with the field's name; the user typed the flag.
_FIELD_FLAGS = {"replicas": "--replicas", "port": "--port", "policy": "--policy",
                "liveness_timeout": "--liveness-timeout", "min_replicas": "--min/--max",
                "serve_args": "the arguments after --"}


def _name_the_flag(message: str) -> str:
    field, sep, rest = message.partition(": ")
    return f"{_FIELD_FLAGS[field]}: {rest}" if sep and field in _FIELD_FLAGS else message


def _default_replicas(args: argparse.Namespace) -> int:
    """2 without autoscaling; with it, --min, but one replica even when --min is 0 (a fleet
    that starts at zero makes its first request wait for a cold start)."""
    if args.min_replicas is None:
        return 2
    return max(1, args.min_replicas)
