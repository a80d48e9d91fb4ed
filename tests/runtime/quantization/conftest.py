"""Fixtures shared by the quantization tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/runtime: model_factory
sys.path.insert(0, str(Path(__file__).parent))  # prequant_factory
