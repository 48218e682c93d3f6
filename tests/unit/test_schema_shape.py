"""gateway/schema_shape.py: a misshapen JSON schema is refused with the path of the keyword at
fault; what JSON Schema allows (pydantic's schemas, booleans, draft-4 forms) passes."""
from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from gateway.schema_shape import MAX_NODES, SchemaProblem, check_schema


class _Item(BaseModel):
    count: int = Field(ge=0, lt=10, multiple_of=2)
    price: float | None = Field(default=None, gt=0.5)


class _Order(BaseModel):
    name: str = Field(min_length=1, max_length=5, pattern="^a")
    items: list[_Item] = Field(min_length=1)
    pair: tuple[int, str]
    kind: Literal["a", "b"]
    by_name: dict[str, _Item]


@pytest.mark.parametrize("schema", [
    True, {}, _Order.model_json_schema(),
    {"type": ["string", "null"], "enum": ["x", None]}, {"items": [{"type": "string"}], "additionalItems": False},
    {"type": "number", "exclusiveMinimum": True, "minimum": 0},   # draft 4
    {"properties": {"type": {"type": "string"}, "properties": {"type": "object"}}},   # keywords as property names
    {"type": "object", "default": {"type": 5}, "const": {"anyOf": []}},   # data, not schemas
])
def test_what_json_schema_allows_passes(schema):
    check_schema(schema)


@pytest.mark.parametrize("schema, path", [
    ({"type": "bogus"}, "type"), ({"type": 5}, "type"), ({"type": []}, "type"), ({"type": ["string", "string"]}, "type"),
    ({"properties": "x"}, "properties"), ({"properties": {"a": {"type": "text"}}}, "properties.a.type"),
    ({"properties": {"a": 1}}, "properties"), ({"required": "a"}, "required"), ({"required": [1]}, "required"),
    ({"anyOf": []}, "anyOf"), ({"items": {"minLength": -1}}, "items.minLength"), ({"items": 3}, "items"),
    ({"$defs": {"x": {"properties": {"y": {"maximum": "3"}}}}}, "$defs.x.properties.y.maximum"),
    ({"multipleOf": 0}, "multipleOf"), ({"maxItems": True}, "maxItems"), ({"enum": "a"}, "enum"),
    ({"not": []}, "not"), ({"oneOf": [{"pattern": 5}]}, "oneOf[0].pattern"), ([], "the schema"),
])
def test_a_misshapen_schema_names_the_keyword_at_fault(schema, path):
    with pytest.raises(SchemaProblem) as caught:
        check_schema(schema)
    assert str(caught.value).startswith(f"{path} "), caught.value


def test_a_deep_schema_costs_no_python_stack():
    schema: dict = {"type": "object"}
    for _ in range(5000):
        schema = {"properties": {"a": schema}}
    check_schema(schema)
    schema["properties"]["a"]["properties"]["a"]["type"] = "nope"
    with pytest.raises(SchemaProblem):
        check_schema(schema)


def test_a_schema_of_more_subschemas_than_the_bound_is_refused_before_they_are_walked():
    at_bound = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_NODES - 1)}}
    check_schema(at_bound)   # the root and its properties: MAX_NODES schemas
    at_bound["properties"]["one_more"] = {}
    with pytest.raises(SchemaProblem, match=f"^properties: the schema has more than {MAX_NODES} subschemas"):
        check_schema(at_bound)
    with pytest.raises(SchemaProblem, match="more than"):   # counted first: its items are never looked at
        check_schema({"anyOf": [5] * (MAX_NODES + 1)})
