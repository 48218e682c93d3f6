"""The gateway's work per request is bounded before it is done: the event loop that parses one
request writes every other client's stream, so a body's lists are refused at their first item
over a bound (and at their first wrong item), and its strings are checked without Python work per
item. Each refusal is a 400 naming the field, and the scheduler is never asked."""
from __future__ import annotations

import sys

import pytest

from gateway.protocol import check_wire_value


def profile_events(fn) -> int:
    """How many Python-level calls (and C calls made from Python) `fn()` makes."""
    count = 0

    def hook(_frame, _event, _arg):
        nonlocal count
        count += 1
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_checking_a_wide_value_makes_no_call_per_item():
    def value(width: int):
        return {"a": ["token"] * width, "b": [list(range(width)), {"c": ["é", 1.5] * width}], "d": [[]] * width}
    assert profile_events(lambda: check_wire_value(value(100_000))) == profile_events(lambda: check_wire_value(value(3)))


@pytest.mark.parametrize("value", [
    ["ok"] * 1000 + ["x\ud800"], {"k": [1, 2, {"é": ["\udfffz"]}]}, {"\ud800": 1}, [1.5, None, True, "a\udc00"],
])
def test_a_lone_surrogate_anywhere_in_a_value_is_found(value):
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        check_wire_value(value)


def test_nesting_is_bounded_at_the_same_depth():
    value: object = 1
    for _ in range(64):
        value = [value]
    check_wire_value(value)
    with pytest.raises(ValueError, match="nests deeper than 64"):
        check_wire_value({"a": value})
