"""A dataclass record to a protobuf message and back, field by field by name: how the sampling
records cross the internal wires (the core/frontend API and the step messages), so a field added
to a record and to its messages travels with no converter to write.

Fields present on both sides travel; a record field that the message lacks takes its default when
decoded. How a field travels follows from the message's own field:
- `optional` scalar: None is unset, and unset decodes as the record's default;
- plain scalar: always written; the record's default (if it has one) must be the wire's zero, or
  the plan refuses to build (make the field `optional`, with its unset meaning in the proto comment);
- repeated scalar: a tuple or a set (a set is sent sorted), decoded as the default's type;
- map: a tuple of (key, value) pairs, decoded sorted by key;
- message: a nested record, or None for unset, coded the same way.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

R = TypeVar("R")
M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: str                     # optional, scalar, repeated, map or message
    default: Any
    record: type | None = None    # the nested record of a message field


def encode(record: Any, message: M) -> M:
    """Writes `record`'s fields into `message` (a fresh one) and returns it."""
    for f in _plan(type(record), type(message)):
        value = getattr(record, f.name)
        if f.kind == "scalar":
            setattr(message, f.name, value)
        elif value is None:
            continue
        elif f.kind == "optional":
            setattr(message, f.name, value)
        elif f.kind == "repeated":
            getattr(message, f.name).extend(sorted(value) if isinstance(value, (set, frozenset)) else value)
        elif f.kind == "map":
            getattr(message, f.name).update(dict(value))
        else:
            nested = getattr(message, f.name)
            nested.SetInParent()
            encode(value, nested)
    return message


def decode(message: Message, record_type: type[R]) -> R:
    """The `record_type` that `message` holds."""
    values = {}
    for f in _plan(record_type, type(message)):
        wire = getattr(message, f.name)
        if f.kind == "scalar":
            values[f.name] = wire
        elif f.kind == "repeated":
            values[f.name] = type(f.default)(wire)
        elif f.kind == "map":
            values[f.name] = tuple(sorted(wire.items()))
        elif message.HasField(f.name):
            values[f.name] = wire if f.kind == "optional" else decode(wire, f.record)
    return record_type(**values)


@functools.cache
def _plan(record_type: type, message_type: type[Message]) -> tuple[_Field, ...]:
    """How each field both sides have travels; TypeError for a record the message cannot carry."""
    wire = message_type.DESCRIPTOR.fields_by_name
    hints = typing.get_type_hints(record_type)
    plan = []
    for field in dataclasses.fields(record_type):
        fd = wire.get(field.name)
        if fd is None:
            continue
        where = f"{record_type.__name__}.{field.name} on {message_type.DESCRIPTOR.full_name}"
        kind = _kind(fd, field.default, where)
        nested = _nested(hints[field.name]) if kind == "message" else None
        if kind == "message" and nested is None:
            raise TypeError(f"{where}: a message field needs a dataclass record (or None) in the record")
        plan.append(_Field(field.name, kind, field.default, nested))
    return tuple(plan)


def _kind(fd, default: Any, where: str) -> str:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return "map"
    if fd.is_repeated:
        if not isinstance(default, (tuple, frozenset)):
            raise TypeError(f"{where}: a repeated field's record default must be a tuple or a frozenset")
        return "repeated"
    if fd.message_type is not None:
        return "message"
    if fd.has_presence:
        if default is dataclasses.MISSING:
            raise TypeError(f"{where}: an optional field needs a record default (what unset means)")
        return "optional"
    if default is not dataclasses.MISSING and default != fd.default_value:
        raise TypeError(f"{where}: the record's default {default!r} is not the wire's unset value "
                        f"{fd.default_value!r}; make the field optional, saying what unset means")
    return "scalar"


def _nested(hint: Any) -> type | None:
    """The dataclass in a field's annotation (`Constraint | None` -> Constraint), if any."""
    candidates = typing.get_args(hint) or (hint,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)
