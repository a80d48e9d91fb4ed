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


_INTEGER_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})
_NUMBER_TYPES = _INTEGER_TYPES | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_BOOL_TYPES = _INTEGER_TYPES | {GGUFValueType.BOOL}
_STRING_TYPES = frozenset({GGUFValueType.STRING})
# The metadata the loader and the tokenizer read (llama.cpp's types, gguf-py's constants.py):
# key -> (what it must be, allowed value types, whether it is an array of them). `{arch}.` keys
# are listed without the architecture prefix. A field of another type would otherwise fail
# deep inside the loader as a TypeError / AttributeError (int() of a list, .split of an int),
# or be silently truncated (a float head count).
_ARCH_FIELD_TYPES: dict[str, tuple[str, frozenset[GGUFValueType], bool]] = {
    **{key: ("an integer", _INTEGER_TYPES, False) for key in (
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "rope.dimension_count", "expert_count", "expert_used_count",
        "expert_feed_forward_length", "expert_shared_feed_forward_length",
        "attention.sliding_window", "rope.scaling.original_context_length")},
    **{key: ("a number", _NUMBER_TYPES, False) for key in (
        "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
        "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_ext_factor", "final_logit_softcapping", "attn_logit_softcapping")},
    "rope.scaling.type": ("a string", _STRING_TYPES, False),
    "expert_weights_norm": ("a bool", _BOOL_TYPES, False),
}
_GLOBAL_FIELD_TYPES: dict[str, tuple[str, frozenset[GGUFValueType], bool]] = {
    "general.architecture": ("a string", _STRING_TYPES, False),
    "split.count": ("an integer", _INTEGER_TYPES, False),
    "split.no": ("an integer", _INTEGER_TYPES, False),
    "tokenizer.ggml.model": ("a string", _STRING_TYPES, False),
    "tokenizer.ggml.pre": ("a string", _STRING_TYPES, False),
    "tokenizer.chat_template": ("a string", _STRING_TYPES, False),
    "tokenizer.ggml.tokens": ("an array of strings", _STRING_TYPES, True),
    "tokenizer.ggml.merges": ("an array of strings", _STRING_TYPES, True),
    "tokenizer.ggml.token_type": ("an array of integers", _INTEGER_TYPES, True),
    "tokenizer.ggml.scores": ("an array of numbers", _NUMBER_TYPES, True),
    **{f"tokenizer.ggml.{key}": ("a bool", _BOOL_TYPES, False)
       for key in ("add_bos_token", "add_eos_token", "add_space_prefix")},
    **{f"tokenizer.ggml.{key}_token_id": ("an integer", _INTEGER_TYPES, False)
       for key in ("bos", "eos", "eot", "eom", "padding", "unknown")},
}


def check_field_types(reader: GGUFReader) -> None:
    """ValueError naming the key for a metadata field the loader reads stored with another type
    than llama.cpp writes (a string head count, an array block count, integer merges)."""
    arch = reader.fields.get("general.architecture")
    prefix = ""
    if arch is not None and arch.types == [GGUFValueType.STRING]:
        prefix = read_field(reader, "general.architecture") + "."
    for key, field in reader.fields.items():
        if key in _GLOBAL_FIELD_TYPES:
            expected = _GLOBAL_FIELD_TYPES[key]
        elif prefix and key.startswith(prefix) and key[len(prefix):] in _ARCH_FIELD_TYPES:
            expected = _ARCH_FIELD_TYPES[key[len(prefix):]]
        else:
            continue
        what, allowed, is_array = expected
        types = list(field.types)
        if is_array:  # [ARRAY, item type]; an empty array has no item type (gguf-py)
            ok = types[:1] == [GGUFValueType.ARRAY] and (
                len(types) == 1 or (len(types) == 2 and types[1] in allowed))
        else:
            ok = len(types) == 1 and types[0] in allowed
        if not ok:
            got = " of ".join(t.name for t in types)
            raise ValueError(f"GGUF metadata {key!r} must be {what}, got {got}")
    # A score / type per token: the tokenizer pairs them by position, so a shorter array
    # would silently drop merges or leave control tokens unmarked (llama.cpp reads past its
    # end; a longer one it ignores, as we do).
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        field = reader.fields.get(key)
        if tokens is not None and field is not None and len(field.data) < len(tokens.data):
            raise ValueError(f"GGUF metadata {key!r} has {len(field.data)} entries for "
                             f"{len(tokens.data)} tokens")


def _part_value(part: Any, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part.tolist()
    if isinstance(value, list):  # scalars are stored as 1-element arrays
        value = value[0]
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    return value
