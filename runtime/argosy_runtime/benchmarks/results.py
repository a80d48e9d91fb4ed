"""The JSON record a bench/ script leaves: what ran, when, where, and what it measured.

Every record starts with the command that reproduces it, the UTC start time and the CPU
count (numbers from a 2-core VM and a 16-core host are not comparable), then the script's
arguments and its own fields.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
from pathlib import Path
from typing import Any


def utc_now() -> str:
    """Now, to the second, as the records write it."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_results(path: str | Path, script: str, argv: list[str], started: str,
                  args: argparse.Namespace, **fields: Any) -> None:
    """Write the record of a run of `script` (as `python script *argv`) to `path`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": shlex.join(["python", script, *argv]), "started_utc": started,
              "cpus": os.cpu_count(), "args": vars(args), **fields}
    out.write_text(json.dumps(record, indent=1) + "\n")
