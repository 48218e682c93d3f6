"""Command-line flags for sampling, made from the fields of the client's SamplingParams
(common/client/sampling.py): each field is a flag named after it, typed by its annotation (a bool is
a switch, a sequence takes several values, a mapping KEY=VALUE entries) and documented by its help
metadata, so a new sampling option reaches the command line without code here.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import typing
from collections import abc
from collections.abc import Mapping
from types import UnionType
from typing import Any

from common.client import SamplingParams

# Options whose value may be long: VALUE, or @FILE to read it from a file.
_FROM_FILE = {"json_schema": "SCHEMA|@FILE", "grammar": "EBNF|@FILE"}


def text_or_file(value: str | None) -> str | None:
    """`value`, or the text of the file it names as @PATH."""
    if value is None or not value.startswith("@"):
        return value
    return pathlib.Path(value[1:]).read_text()


def _pair(key_type: type, value_type: type, metavar: str):
    """argparse type of one KEY=VALUE entry of a mapping option."""
    def parse(text: str) -> tuple:
        key, sep, value = text.partition("=")
        try:
            if not sep:
                raise ValueError
            return key_type(key), value_type(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {metavar}, got {text!r}") from None
    return parse


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _member(hint: Any) -> Any:
    """The type a flag parses for a field of type `hint`: `int | None` -> int; a JSON schema as a
    dict or its text -> str."""
    members = [m for m in typing.get_args(hint) if m is not type(None)] if isinstance(hint, UnionType) else [hint]
    return str if str in members else members[0]


def _flag(hint: Any, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """argparse keywords for a SamplingParams field of type `hint` (unset: None, or [] for several values)."""
    member = _member(hint)
    origin, args = typing.get_origin(member), typing.get_args(member)
    if member is bool:
        # A switch; a bool that may be unset (the server's default) takes true or false.
        return dict(action="store_true") if member is hint else dict(default=None, type=_boolean,
                                                                     metavar="{true,false}")
    if origin is abc.Mapping:
        metavar = metadata.get("metavar", "KEY=VALUE")
        return dict(nargs="+", default=[], type=_pair(*args, metavar), metavar=metavar)
    if origin is abc.Sequence:
        return dict(nargs="+", default=[], type=args[0])
    return dict(default=None, type=member)


def add_sampling_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """A flag for each field of the client's SamplingParams, named after it (--top-p for top_p);
    `defaults` override the server's (unset) for some."""
    group = p.add_argument_group("sampling", "the fields of common.client.SamplingParams; "
                                             "at most one of the structured-output ones")
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        flag = _flag(hints[f.name], f.metadata)
        if f.name in defaults:
            flag["default"] = defaults[f.name]
        if f.name in _FROM_FILE:
            flag["metavar"] = _FROM_FILE[f.name]
        group.add_argument("--" + f.name.replace("_", "-"), help=f.metadata.get("help"), **flag)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams keywords the flags give (a mapping's entries as a dict, None when none)."""
    hints = typing.get_type_hints(SamplingParams)
    options = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(args, f.name)
        if f.name in _FROM_FILE:
            value = text_or_file(value)
        elif typing.get_origin(_member(hints[f.name])) is abc.Mapping:
            value = dict(value) or None
        options[f.name] = value
    return options
