"""Reading GGUF metadata values without depending on a particular `gguf` package version."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader, GGUFValueType

_MISSING = object()


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
