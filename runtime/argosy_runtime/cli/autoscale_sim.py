"""`argosy autoscale-sim --policy POLICY.yaml --trace TRACE.jsonl`: replay a metrics trace.

Prints one JSON line per trace line: `{"t":..., "current":..., "desired":..., "reason":...}`,
computed by the operator's own decision function (argosy_operator.autoscaling). Never imports
torch. Exit status 2 on an invalid policy or trace.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "autoscale-sim",
        help="Replay a recorded metrics trace through the autoscaling policy.",
        description="Replay a JSON-lines metrics trace through the LLMDeployment autoscaler and "
                    "print one JSON decision per line (see docs/autoscaling.md).",
    )
    parser.add_argument("--policy", required=True,
                        help="YAML: spec.autoscaling mapping, {autoscaling: ...}, or an "
                             "LLMDeployment manifest")
    parser.add_argument("--trace", required=True, help="JSON-lines trace file ('-' for stdin)")
    parser.add_argument("--verbose", action="store_true",
                        help="add panic, limit, kv, queue, demand and message to each line")
    return parser


def run(args: argparse.Namespace) -> int:
    import yaml
    from argosy_operator.autoscaling.simulator import load_policy, read_trace, simulate

    try:
        policy = load_policy(args.policy)
    except (OSError, ValueError) as exc:
        print(f"argosy autoscale-sim: policy {args.policy}: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:  # not a ValueError: was a traceback
        print(f"argosy autoscale-sim: policy {args.policy}: not valid YAML: "
              f"{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        trace_file = sys.stdin if args.trace == "-" else open(args.trace, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        print(f"argosy autoscale-sim: trace {args.trace}: {exc}", file=sys.stderr)
        return 2
    try:
        with trace_file:
            for record in simulate(policy, read_trace(trace_file), verbose=args.verbose):
                sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
    except ValueError as exc:
        print(f"argosy autoscale-sim: trace {args.trace}: {exc}", file=sys.stderr)
        return 2
    return 0
