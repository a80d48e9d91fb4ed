"""`argosy bench offline|serve`: the benchmarks (modules in argosy_runtime.benchmarks)."""

from __future__ import annotations

import argparse
import importlib
import sys

# bench kind -> module in argosy_runtime.benchmarks defining add_arguments(parser) and run(args)
KINDS = {
    "offline": ("offline", "LLM.generate against transformers (and vLLM where installed)."),
    "serve": ("serve", "Open-loop load generator against any OpenAI-compatible server."),
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="Run a benchmark.", description=__doc__)
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    for kind, (module_name, help_text) in KINDS.items():
        module = importlib.import_module(f"argosy_runtime.benchmarks.{module_name}")
        sub = kinds.add_parser(kind, help=help_text, description=help_text)
        module.add_arguments(sub)
        _show_defaults(sub)
        sub.set_defaults(_bench_run=module.run)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to each option's help that does not name its default yet, so
    `argosy bench KIND --help` says what an option left out means (--json, for one, writes a
    file unasked). Secrets (--api-key, from $ARGOSY_API_KEY) are never printed."""
    for action in parser._actions:
        text = action.help or ""
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or "default" in text or action.default in (None, [], argparse.SUPPRESS)
                or "key" in action.dest):
            continue
        action.help = f"{text} (default: %(default)s)".lstrip()


def run(args: argparse.Namespace) -> int:
    try:
        return int(args._bench_run(args) or 0)
    except ValueError as exc:
        # A bad option the benchmark only reads at run time (--batch-sizes a,b, an unknown
        # --engine-arg, an --input-len the engine refuses): one line, not a traceback.
        print(f"argosy bench {args.bench_kind}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # A file it reads or writes (--compare, --json, --markdown): a FileNotFoundError
        # traceback, exit 1, the writes only once the whole benchmark had run.
        print(f"argosy bench {args.bench_kind}: error: {exc}", file=sys.stderr)
        return 2
