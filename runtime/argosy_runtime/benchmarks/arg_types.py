"""argparse types shared by the benchmarks' options.

A value refused here is reported by argparse naming its flag (`argument --input-len: ...`,
exit 2) before anything loads, instead of an error from deep inside the run that says
`input_len` or nothing at all.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def names_from(choices: tuple[str, ...]):
    """A comma-separated subset of `choices` ("transformers,vllm"); an empty text is none.
    A misspelt name was skipped without a word, so the peer it meant never ran."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
        return names

    return parse
