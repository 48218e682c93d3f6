"""common/strict_json: JSON reads back as json.loads reads it; the numbers JSON does not have
(NaN, Infinity, -Infinity, 1e999) are refused naming the number and where it sits; nesting past a
bound, or past the parser's recursion, is a JsonProblem too."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from common.strict_json import JsonProblem, loads, measure

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=3),
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
def test_valid_json_reads_back_as_it_was_written(value):
    text = json.dumps(value)
    assert loads(text) == value == loads(text.encode("utf-8"))
    assert loads(text, max_depth=measure(value)[0]) == value


@given(JSON_VALUES)
def test_measure_counts_depth_and_values_as_the_recursive_definition_does(value):
    assert measure(value) == recursive_measure(value)


@pytest.mark.parametrize("text, number, problem, path", [
    ("NaN", "NaN", "NaN is not a JSON number", None),
    ('{"a": Infinity}', "Infinity", "Infinity is not a JSON number", "a"),
    ('[1, {"y": -Infinity}]', "-Infinity", "-Infinity is not a JSON number", "[1].y"),
    ('{"tools": [{"parameters": {"a": 1e999}}]}', "1e999", "number 1e999 is out of range", "tools[0].parameters.a"),
    ('{"x": -1.5e400}', "-1.5e400", "number -1.5e400 is out of range", "x"),
    (b'{"t": [0.5, NaN]}', "NaN", "NaN is not a JSON number", "t[1]"),
])
def test_numbers_json_does_not_have_are_refused_naming_them_and_where(text, number, problem, path):
    with pytest.raises(JsonProblem) as refused:
        loads(text)
    assert str(refused.value) == f"not valid JSON: {problem}"
    assert (refused.value.number, refused.value.path) == (number, path)


def test_the_path_is_of_the_first_such_number_even_under_a_duplicate_key():
    """A duplicate key's later value wins in the parsed object; the path still names the first."""
    with pytest.raises(JsonProblem) as refused:
        loads('{"a": NaN, "a": 1, "b": Infinity}')
    assert (refused.value.number, refused.value.path) == ("NaN", "a")
    assert loads('{"a": 1, "a": 2}') == {"a": 2}     # duplicates otherwise read as json.loads reads them


def test_the_path_is_unknown_when_the_text_breaks_after_the_number():
    with pytest.raises(JsonProblem, match="NaN is not a JSON number") as refused:
        loads('{"a": NaN, "b": ')
    assert (refused.value.number, refused.value.path) == ("NaN", None)


@pytest.mark.parametrize("text", ['{"type": ', "", "[1,]", b'{"a": "\xff"}', "1" * 5000])
def test_invalid_json_is_refused_with_the_parsers_error_as_its_cause(text):
    with pytest.raises(JsonProblem, match="^not valid JSON: ") as refused:
        loads(text)
    assert refused.value.number is None and isinstance(refused.value.__cause__, ValueError)


def test_nesting_past_the_bound_is_refused_with_its_depth():
    assert loads("[" * 32 + "]" * 32, max_depth=32) is not None
    with pytest.raises(JsonProblem, match="^nested 33 levels deep, more than the limit of 32$"):
        loads("[" * 33 + "]" * 33, max_depth=32)


@pytest.mark.parametrize("max_depth, says", [(32, "nested more than 32 levels deep, the limit"),
                                             (None, "nested deeper than the parser allows")])
def test_nesting_past_the_parsers_recursion_is_a_problem_not_a_recursion_error(max_depth, says):
    with pytest.raises(JsonProblem, match=f"^{says}$") as refused:
        loads("[" * 100_000 + "]" * 100_000, max_depth=max_depth)
    assert isinstance(refused.value.__cause__, RecursionError)
