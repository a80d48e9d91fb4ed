"""Reading GGUF metadata values without depending on a particular `gguf` package version."""

from __future__ import annotations

import os
import struct
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

    # Overrides gguf-py's private `_get_field_parts` (gguf 0.19; tests/runtime/model_loader/
    # test_gguf_metadata.py checks it still exists and that our fields equal plain GGUFReader's).
    # gguf-py parses an array one element at a time, ~4 numpy calls each: ~0.6 s for SmolLM2's
    # 49k tokens + 49k merges, ~4x that for Llama 3's. Here an array of scalars or strings is
    # parsed in one pass and yields the same parts, data indexes and types. Anything else
    # (scalars, nested arrays, byte-swapped files, an array cut off by the end of the file)
    # goes to gguf-py, which also keeps its errors for malformed files.
    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1 or alen[0] == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        parsed, parts_per_item = None, 1
        if item_type == GGUFValueType.STRING:
            parsed, parts_per_item = self._string_array_parts(offs, count), 2
        elif item_type in self.gguf_scalar_to_np:
            parsed = self._scalar_array_parts(offs, count, self.gguf_scalar_to_np[item_type])
        if parsed is None:
            return super()._get_field_parts(orig_offs, raw_type)
        size, item_parts = parsed
        # gguf-py's layout: [item type, length, then each item's parts]; the data indexes point
        # at each item's last part (a string's bytes, after its length).
        data = list(range(1 + parts_per_item, 2 + len(item_parts), parts_per_item))
        return size + 12, [raw_itype, alen, *item_parts], data, [GGUFValueType.ARRAY, item_type]

    def _scalar_array_parts(self, offs: int, count: int, nptype: type[np.generic]
                            ) -> tuple[int, list[np.ndarray]] | None:
        """(bytes read, a 1-element view per item), or None past the end of the file."""
        size = count * np.dtype(nptype).itemsize
        if offs + size > len(self.data):
            return None
        # Rows of a (count, 1) view: each item's 1-element array, made in C rather than by a
        # Python-level slice per item.
        return size, list(self.data[offs:offs + size].view(nptype).reshape(count, 1))

    def _string_array_parts(self, offs: int, count: int
                            ) -> tuple[int, list[np.ndarray]] | None:
        """(bytes read, [length, bytes] parts per item), or None past the end of the file."""
        data, start = self.data, offs
        read_length = struct.Struct("=Q").unpack_from  # native order: byte_order is "I"
        lengths, strings = [], []
        try:
            for _ in range(count):
                (length,) = read_length(data, offs)
                lengths.append(length)
                strings.append(data[offs + 8:offs + 8 + length])
                offs += 8 + length
        except struct.error:  # a length past the end of the file
            return None
        if offs > len(data):  # the last string cut short
            return None
        # The lengths as 1-element uint64 arrays like gguf-py's, but copies rather than one view
        # per item into the file: read-only, so a write fails instead of missing the file.
        length_array = np.array(lengths, dtype=np.uint64)
        length_array.flags.writeable = False
        parts = [part for pair in zip(length_array.reshape(count, 1), strings) for part in pair]
        return offs - start, parts


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
        items = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:  # tobytes: ~2x faster than bytes(item)
            return [item.tobytes().decode("utf-8") for item in items]
        # One conversion for the whole array rather than one per item (~50k token types).
        return np.concatenate(items).tolist() if items else []
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
