from __future__ import annotations

import pytest
from argosy_runtime.quantization import QuantizationConfig


def test_valid_configs() -> None:
    assert QuantizationConfig("int8").bits == 8
    for g in (32, 64, 128):
        assert QuantizationConfig("int4", group_size=g).describe() == f"int4-g{g}"
    assert QuantizationConfig("int4", 64, source="gptq").describe() == "int4-g64 (gptq)"
    # int8 is per channel: the group size (the engine always passes one) is not used.
    assert QuantizationConfig("int8", group_size=100).describe() == "int8"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"method": "fp8"}, "method"),
        ({"method": "INT4"}, "method"),
        ({"method": "int4", "group_size": 48}, "group_size"),
        ({"method": "int4", "group_size": 256}, "group_size"),
        ({"method": "int4", "group_size": "128"}, "group_size"),
        ({"method": "int4", "source": "exl2"}, "source"),
    ],
)
def test_invalid_configs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        QuantizationConfig(**kwargs)
