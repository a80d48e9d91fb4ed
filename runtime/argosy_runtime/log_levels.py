"""The `--log-level` flag shared by `argosy serve`, `argosy gateway` and `argosy fleet`.

A module of its own, free of heavy imports, because the gateway must never import torch.
"""

from __future__ import annotations

import argparse

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    # choices: logging.basicConfig raised a ValueError traceback for an unknown level;
    # str.lower: INFO and info both work, as in the Python logging module's own names.
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="Python logging level (default: %(default)s).")
