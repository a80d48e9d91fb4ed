"""Reading GGUF metadata values without depending on a particular `gguf` package version."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_MISSING = object()


class _PlainArrayGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of the memory map.

    GGUFReader slices its `np.memmap` once per metadata item (~250k slices for a 49k-token
    vocabulary), and every memmap slice pays numpy's memmap bookkeeping: parsing took ~5x longer
    than with a plain ndarray view of the same mapping. The view keeps the file mapped lazily
    (the memmap stays alive as its base), so tensors are still paged in on demand.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open and parse a GGUF file (metadata and tensor index; tensor data stays mapped)."""
    return _PlainArrayGGUFReader(path)


def read_field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata field `key`: a Python scalar, str, or list (for arrays).

    Raises KeyError naming the key when it is absent and no default is given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata has no field {key!r}")
        return default
    main_type = field.types[0]
    if main_type == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        return [_part_value(field.parts[i], item_type) for i in field.data]
    return _part_value(field.parts[field.data[0]], main_type)


def _part_value(part: Any, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()
    if isinstance(value, list):  # scalars are stored as 1-element arrays
        value = value[0]
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    return value
