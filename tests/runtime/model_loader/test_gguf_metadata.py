"""open_gguf / read_field: the same metadata and tensor index as gguf-py's own GGUFReader.

_PlainArrayGGUFReader parses arrays of scalars and strings in one pass by overriding gguf-py's
private `_get_field_parts`; these tests compare every field, part and tensor with plain
GGUFReader's on the same file, and fail loudly if gguf-py stops calling the override."""

from __future__ import annotations

import inspect
import struct
from pathlib import Path

import numpy as np
import pytest
from argosy_runtime.model_loader.gguf_metadata import _PlainArrayGGUFReader, open_gguf, read_field
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from model_factory import make_random_model_dir, write_gguf_from_hf_dir

T = GGUFValueType
_FORMATS = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i",
            T.FLOAT32: "f", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d", T.BOOL: "?"}
_SCALARS = {T.UINT8: 200, T.INT8: -100, T.UINT16: 60000, T.INT16: -30000, T.UINT32: 4_000_000_000,
            T.INT32: -2_000_000_000, T.FLOAT32: 0.5, T.UINT64: 2**63 + 5, T.INT64: -(2**62),
            T.FLOAT64: 1e-300, T.BOOL: True}


def _encode(vtype: GGUFValueType, value: object) -> bytes:
    """A GGUF value (without its type tag); an array's value is (item type, [items])."""
    if vtype == T.STRING:
        raw = value.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == T.ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(
            _encode(item_type, item) for item in items)
    return struct.pack("<" + _FORMATS[vtype], value)


def _all_types_gguf(path: Path) -> Path:
    """Every value type, as scalars and as arrays (also empty and nested, which GGUFWriter
    refuses or cannot type explicitly): written byte by byte, no tensors."""
    kvs: list[tuple[str, GGUFValueType, object]] = [("general.architecture", T.STRING, "llama")]
    for vtype, value in _SCALARS.items():
        name = vtype.name.lower()
        kvs.append((f"scalar.{name}", vtype, value))
        kvs.append((f"array.{name}", T.ARRAY, (vtype, [value, 0, value])))
        kvs.append((f"empty.{name}", T.ARRAY, (vtype, [])))
    kvs += [
        ("scalar.string", T.STRING, "héllo ✓"),
        ("scalar.empty_string", T.STRING, ""),
        ("array.string", T.ARRAY, (T.STRING, ["a", "", "Ġthe", "日本語", "x" * 300])),
        ("empty.string", T.ARRAY, (T.STRING, [])),
        ("nested.int32", T.ARRAY, (T.ARRAY, [(T.INT32, [1, 2]), (T.INT32, []), (T.INT32, [3])])),
        ("nested.string", T.ARRAY, (T.ARRAY, [(T.STRING, ["a", "bc"]), (T.STRING, ["d"])])),
        ("empty.nested", T.ARRAY, (T.ARRAY, [])),
        ("after.arrays", T.UINT32, 7),  # parsing resumes at the right offset
    ]
    body = b"".join(_encode(T.STRING, key) + struct.pack("<I", vtype) + _encode(vtype, value)
                    for key, vtype, value in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body)
    return path


def _assert_same_as_gguf_py(path: Path) -> None:
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert isinstance(ours, _PlainArrayGGUFReader)
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.data, got.types) == (
            want.offset, want.name, want.data, want.types), key
        assert len(got.parts) == len(want.parts), key
        for got_part, want_part in zip(got.parts, want.parts):
            assert got_part.dtype == want_part.dtype and got_part.shape == want_part.shape, key
            assert np.array_equal(got_part, want_part), key
        assert read_field(ours, key) == want.contents(), key
        assert got.contents() == want.contents(), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert len(ours.tensors) == len(theirs.tensors)
    for got_tensor, want_tensor in zip(ours.tensors, theirs.tensors):
        assert (got_tensor.name, got_tensor.tensor_type, got_tensor.n_elements,
                got_tensor.n_bytes, got_tensor.data_offset) == (
            want_tensor.name, want_tensor.tensor_type, want_tensor.n_elements,
            want_tensor.n_bytes, want_tensor.data_offset)
        assert np.array_equal(got_tensor.shape, want_tensor.shape)
        assert np.array_equal(got_tensor.data, want_tensor.data), got_tensor.name


def test_embedded_gguf_same_as_gguf_py(gguf_path: Path) -> None:
    _assert_same_as_gguf_py(gguf_path)


def test_every_value_type_same_as_gguf_py(tmp_path: Path) -> None:
    path = _all_types_gguf(tmp_path / "all-types.gguf")
    _assert_same_as_gguf_py(path)
    reader = open_gguf(path)
    assert read_field(reader, "array.string") == ["a", "", "Ġthe", "日本語", "x" * 300]
    assert read_field(reader, "array.float32") == [0.5, 0.0, 0.5]
    assert read_field(reader, "array.bool") == [True, False, True]
    assert read_field(reader, "array.uint64") == [2**63 + 5, 0, 2**63 + 5]
    assert read_field(reader, "empty.string") == [] and read_field(reader, "empty.int8") == []
    assert read_field(reader, "nested.int32") == [1, 2, 3]  # gguf-py flattens nested arrays
    assert read_field(reader, "nested.string") == ["a", "bc", "d"]
    assert read_field(reader, "scalar.bool") is True
    assert read_field(reader, "scalar.empty_string") == ""
    assert read_field(reader, "after.arrays") == 7


def test_big_endian_gguf_same_as_gguf_py(tmp_path: Path) -> None:
    """Byte-swapped files take gguf-py's own path."""
    path = tmp_path / "big-endian.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    writer.add_array("array.int32", [1, -2, 3])
    writer.add_array("array.float32", [0.25, 1.5])
    writer.add_array("array.string", ["a", "bc"])
    writer.add_tensor("t.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_gguf_py(path)
    assert read_field(open_gguf(path), "array.int32") == [1, -2, 3]


def test_truncated_gguf_fails_as_gguf_py(tmp_path: Path) -> None:
    """A file cut anywhere (inside an array too) fails, or parses, exactly as with gguf-py."""
    whole = _all_types_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in range(1, len(whole)):
        path.write_bytes(whole[:cut])
        outcomes = []
        for reader_type in (_PlainArrayGGUFReader, GGUFReader):
            try:
                reader = reader_type(path)
            except Exception as exc:  # noqa: BLE001 - comparing whatever gguf-py raises
                outcomes.append(repr(exc))
            else:
                outcomes.append([(f.name, f.data, f.types) for f in reader.fields.values()])
        assert outcomes[0] == outcomes[1], cut


@pytest.mark.parametrize("arch", ["llama", "qwen2-f16", "mixtral", "phi3"])
def test_written_gguf_same_as_gguf_py(arch: str, tmp_path: Path) -> None:
    kwargs: dict = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "num_key_value_heads": 2}
    if arch == "mixtral":
        kwargs |= dict(intermediate_size=32,
                       extra_config=dict(num_local_experts=4, num_experts_per_tok=2))
    if arch == "phi3":
        kwargs |= dict(max_position_embeddings=256,
                       extra_config={"original_max_position_embeddings": 256})
    folder = make_random_model_dir(tmp_path, arch.removesuffix("-f16"), **kwargs)
    path = write_gguf_from_hf_dir(folder, tmp_path / f"{arch}.gguf",
                                  float16=arch.endswith("-f16"))
    _assert_same_as_gguf_py(path)


def test_gguf_py_still_calls_the_override(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """_PlainArrayGGUFReader overrides gguf-py's private GGUFReader._get_field_parts: if gguf-py
    renames it, changes its signature or stops calling it, this fails (the override would be
    dead code, or be called wrongly) and gguf_metadata.py needs updating."""
    assert list(inspect.signature(GGUFReader._get_field_parts).parameters) == [
        "self", "orig_offs", "raw_type"]
    assert set(GGUFReader.gguf_scalar_to_np) == set(_FORMATS)
    calls: list[str] = []
    for name in ("_string_array_parts", "_scalar_array_parts"):
        original = getattr(_PlainArrayGGUFReader, name)

        def counted(self, *args, _original=original, _name=name):  # noqa: ANN001, ANN002, ANN202
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(_PlainArrayGGUFReader, name, counted)
    open_gguf(_all_types_gguf(tmp_path / "all-types.gguf"))
    assert "_string_array_parts" in calls and "_scalar_array_parts" in calls
