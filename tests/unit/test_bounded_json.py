"""bounded_json: a schema past its depth or its number of values refused with what is wrong, and
a number JSON does not have refused as invalid JSON (common/strict_json.py parses it)."""
from __future__ import annotations

import json

import pytest

from common.strict_json import JsonProblem
from scheduler_svc.frontend.bounded_json import parse_json_object, parse_schema


def test_a_schema_of_too_many_values_is_refused_with_its_count():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(JsonProblem, match="has 4003 JSON values, more than the limit of 4000"):
        parse_schema(json.dumps(wide), max_depth=8, max_nodes=4000)
    assert parse_schema(json.dumps(wide), max_depth=8, max_nodes=4003) == wide


def test_a_value_nested_past_the_bound_is_refused_with_its_depth():
    deep = '{"a": ' * 40 + "1" + "}" * 40
    with pytest.raises(JsonProblem, match="nested 40 levels deep, more than the limit of 32"):
        parse_json_object(deep, max_depth=32)
    with pytest.raises(JsonProblem, match="must be a JSON object"):
        parse_schema("[1]", max_depth=8, max_nodes=8)
    with pytest.raises(JsonProblem, match="must be a JSON object, got list"):
        parse_json_object("[]", max_depth=8)


@pytest.mark.parametrize("text, problem", [
    ('{"type": "number", "minimum": NaN}', "NaN is not a JSON number"),
    ('{"maximum": -Infinity}', "-Infinity is not a JSON number"),
    ('{"maximum": 1e999}', "number 1e999 is out of range"),
])
def test_numbers_json_cannot_hold_are_not_valid_json(text, problem):
    """Python's json reads them; a grammar compiler refuses them, quoting the whole text."""
    with pytest.raises(JsonProblem, match=f"not valid JSON: {problem}"):
        parse_schema(text, max_depth=8, max_nodes=8)
