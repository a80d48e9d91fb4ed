"""StructuredOutputsParams and the new SamplingParams fields: every malformed value is a
ValueError naming its field."""

from __future__ import annotations

import pytest
from argosy_runtime import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs", [
    {"json": {"type": "object"}},
    {"json": '{"type": "integer"}'},
    {"json": True},
    {"regex": "[0-9]+"},
    {"choice": ["yes", "no"]},
    {"grammar": 'start: "a"+'},
    {"json_object": True},
    {"json_object": True, "disable_any_whitespace": True},
])
def test_exactly_one_constraint_is_accepted(kwargs: dict) -> None:
    params = StructuredOutputsParams(**kwargs)
    assert params.key == StructuredOutputsParams(**kwargs).key


def test_json_text_is_parsed_and_booleans_become_schemas() -> None:
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    assert StructuredOutputsParams(json=True).json == {}
    assert StructuredOutputsParams(json=False).json == {"not": {}}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema object"),
    # JSON text nested deeper than Python's recursion limit: a RecursionError (a 500) before
    ({"json": "[" * 5000 + "]" * 5000}, "structured_outputs.json is nested too deeply"),
    ({"json": '{"items":' * 3000 + "{}" + "}" * 3000}, "structured_outputs.json is nested too"),
    # integers llguidance cannot take: past 64 bits its error named no field (a 400 with
    # param null); near -2**63 it crashed the whole process (SIGSEGV, see test_grammar.py)
    ({"json": {"type": "integer", "minimum": 10**30}},
     r"^structured_outputs.json: the integer 10{30} is out of the supported range"),
    ({"json": {"const": -(2**63)}}, "structured_outputs.json: the integer -9223372036854775808"),
    ({"json": '{"enum": [1, -9223372036854775296]}'}, "structured_outputs.json: the integer"),
    ({"grammar": 'start: %json{"const": -9223372036854775808}'},
     "structured_outputs.grammar: the integer -9223372036854775808 is out of"),
    # a multipleOf llguidance compiles for seconds to hours (and GBs): 2**24 took over 20 s
    ({"json": {"type": "integer", "multipleOf": 2**24}}, "multipleOf 16777216 has too many"),
    ({"json": {"type": "number", "multipleOf": 0.99991}}, "multipleOf 0.99991 has too many"),
    ({"json": {"properties": {"a": {"multipleOf": 999983}}}}, "structured_outputs.json: "),
    ({"json": {"multipleOf": 10**400}}, "multipleOf 1000"),  # no OverflowError (a 500)
    ({"grammar": 'start: %json{"type": "integer", "multipleOf": 99991000}'},
     "structured_outputs.grammar: multipleOf 99991000 has too many digits"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
    ({"regex": "a" * 100_001}, "longer than"),
    ({"choice": []}, "structured_outputs.choice must be a list"),
    ({"choice": "yes"}, "structured_outputs.choice must be a list"),
    ({"choice": ["yes", ""]}, r"structured_outputs.choice\[1\]"),
    ({"json_object": False}, "json_object must be true"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ({"json_object": True, "disable_additional_properties": 1},
     "structured_outputs.disable_additional_properties must be a boolean"),
    ({"json_object": True, "whitespace_pattern": 5},
     "structured_outputs.whitespace_pattern must be a string"),
    ({"json_object": True, "whitespace_pattern": " " * 100_001},
     "structured_outputs.whitespace_pattern must be a string of at most"),
    # llguidance lets the pattern win: whitespace the client asked to disable would pass
    ({"json_object": True, "whitespace_pattern": "[ ]?", "disable_any_whitespace": True},
     "structured_outputs.whitespace_pattern cannot be used with disable_any_whitespace"),
])
def test_malformed_constraints_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_key_tells_specs_apart() -> None:
    keys = {StructuredOutputsParams(json={"type": "object"}).key,
            StructuredOutputsParams(json_object=True).key,
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True).key,
            StructuredOutputsParams(regex="a").key,
            StructuredOutputsParams(grammar="a").key}
    assert len(keys) == 5


@pytest.mark.parametrize(("bias", "message"), [
    ({1: 101.0}, r"logit_bias\[1\] must be in \[-100.0, 100.0\]"),
    ({1: float("nan")}, r"logit_bias\[1\]"),
    ({-1: 1.0}, "logit_bias token id"),
    ({"1": 1.0}, "logit_bias token id must be an integer"),
    ([1, 2], "logit_bias must map token ids to numbers"),
])
def test_logit_bias_is_validated(bias, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_structured_outputs_must_be_the_params_class() -> None:
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
