"""StructuredOutputsParams: one constraint, validated, one canonical spelling on the wire."""
import pytest

from tokenmill import SamplingParams
from tokenmill.distributed import serial
from tokenmill.structured.params import StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize("fields, message", [
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON schema"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty strings"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
])
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_schema_dict_and_string_are_the_same_key_and_keep_property_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type":"object","properties":{"b":{},"a":{}}}')
    assert a.key == b.key and a.json == b.json
    assert a.json.index('"b"') < a.json.index('"a"')   # output order follows the schema
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=False).key


def test_sampling_params_take_a_dict_and_cross_the_wire():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs.kind == "choice"
    again = serial.decode(serial.encode(params))
    assert again == params and again.structured_outputs.key == params.structured_outputs.key


def test_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"json_schema": {}})
