"""common/json_schema.py: where a JSON schema nests other schemas."""
from __future__ import annotations

from common.json_schema import SCHEMA_KEYWORDS, subschemas


def test_each_nesting_keyword_lists_its_schemas_with_where_they_sit():
    a, b = {"type": "string"}, {"type": "null"}
    assert subschemas("properties", {"x": a, "y": b}) == [("x", a), ("y", b)]
    assert subschemas("anyOf", [a, b]) == [(0, a), (1, b)]
    assert subschemas("additionalProperties", a) == [(None, a)]
    assert subschemas("not", False) == [(None, False)]


def test_items_is_one_schema_or_a_list_of_them():
    a, b = {"type": "string"}, {"type": "null"}
    assert subschemas("items", a) == [(None, a)]
    assert subschemas("items", [a, b]) == [(0, a), (1, b)]


def test_a_keyword_that_nests_no_schema_or_holds_the_wrong_shape_lists_none():
    assert subschemas("required", ["x"]) == []
    assert subschemas("enum", [{"type": "string"}]) == []
    assert subschemas("properties", [{"type": "string"}]) == []
    assert subschemas("allOf", {"type": "string"}) == []


def test_every_keyword_is_listed_once():
    assert len(set(SCHEMA_KEYWORDS)) == len(SCHEMA_KEYWORDS)
