"""bounded_json: a value's depth and number of values as a recursive walk counts them, and a schema
past either bound refused with what is wrong."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from scheduler_svc.frontend.bounded_json import JsonProblem, measure, parse_json, parse_schema

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=2), children, max_size=4),
    max_leaves=40)


def recursive_measure(value) -> tuple[int, int]:
    """The definition: a scalar is depth 0 and one value; a container is one deeper than its
    deepest child (at least 1) and one value more than its children together."""
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None:
        return 0, 1
    measured = [recursive_measure(child) for child in children]
    return 1 + max((d for d, _ in measured), default=0), 1 + sum(n for _, n in measured)


@given(JSON_VALUES)
def test_measure_counts_depth_and_values_as_the_recursive_definition_does(value):
    assert measure(value) == recursive_measure(value)


def test_a_schema_of_too_many_values_is_refused_with_its_count():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(JsonProblem, match="has 4003 JSON values, more than the limit of 4000"):
        parse_schema(json.dumps(wide), max_depth=8, max_nodes=4000)
    assert parse_schema(json.dumps(wide), max_depth=8, max_nodes=4003) == wide


def test_a_value_nested_past_the_bound_is_refused_with_its_depth():
    deep = "[" * 40 + "]" * 40
    with pytest.raises(JsonProblem, match="nested 40 levels deep, more than the limit of 32"):
        parse_json(deep, max_depth=32)
    with pytest.raises(JsonProblem, match="must be a JSON object"):
        parse_schema("[1]", max_depth=8, max_nodes=8)


@pytest.mark.parametrize("text, problem", [
    ('{"type": "number", "minimum": NaN}', "NaN is not a JSON number"),
    ('{"maximum": -Infinity}', "-Infinity is not a JSON number"),
    ('{"maximum": 1e999}', "number 1e999 is out of range"),
])
def test_numbers_json_cannot_hold_are_not_valid_json(text, problem):
    """Python's json reads them; a grammar compiler refuses them, quoting the whole text."""
    with pytest.raises(JsonProblem, match=f"not valid JSON: {problem}"):
        parse_schema(text, max_depth=8, max_nodes=8)
