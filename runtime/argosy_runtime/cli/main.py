"""`argosy` entry point.

Each subcommand lives in its own module `argosy_runtime.cli.<module>` that defines
`add_parser(subparsers) -> argparse.ArgumentParser` and `run(args) -> int`. Subcommand modules
import heavy dependencies (torch, uvicorn, kopf) only inside `run`, so `argosy --help`,
`argosy gateway` and `argosy operator` stay fast and never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# One module per subcommand, in --help order (each registers its own name).
SUBCOMMAND_MODULES = (
    "serve", "bench", "perplexity", "gateway", "fleet", "operator_cmd", "autoscale_sim",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="argosy",
        description="Argosy: serve large language models fast and cheaply.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(f"argosy_runtime.cli.{module_name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C where a subcommand has no handler of its own (importing torch, loading a
        # model for bench or perplexity): one line, not a traceback, and the shell's code.
        print(f"argosy {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
