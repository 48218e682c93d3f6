"""The command line every program of the project shares: each flag can come from the environment,
and --help shows each flag's default and its variable.

`ArgumentParser` is argparse's with one addition: an optional flag `--max-num-seqs` also reads
`QWEN3_SERVE_MAX_NUM_SEQS` (the prefix, then the longest option name upper-cased with dashes as
underscores). Precedence is command line > environment > the default written in the code, so a
container can be configured by variables alone and a person can still override one on the
command line. A variable for a flag without a value (`--enforce-eager`) is read as a boolean
(1/true/yes/on, 0/false/no/off) meaning "as if the flag were given"; one for a flag that takes
several values (`nargs="+"`) is split on whitespace. A bad value is a usage error that names the
variable, exactly like a bad flag. Positional arguments have no variable.

A config dataclass states its flags once: `flag(default, help=...)` on a field gives its default,
help, choices and spelling; `add_config_arguments` adds one argument per such field (the type
comes from the annotation) and `config_from_args` builds the dataclass from the parsed flags. An
old spelling of a renamed flag (`aliases`) still parses, and its variable still sets the flag,
without appearing in --help. `markdown_table` renders a parser's flags for docs/FLAGS.md.

It also holds what the servers share about where they listen: `is_loopback` and
`warn_if_exposed` (a server reachable from other machines without a token or TLS says so loudly
at start-up).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import ipaddress
import logging
import os
import socket
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from common.logging_setup import LOG_FORMATS

ENV_PREFIX = "QWEN3_SERVE_"
CLI_METADATA = "cli"     # the key of a field's Flag in dataclasses.Field.metadata

Config = TypeVar("Config")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
# Actions that take no value: their variable is a boolean meaning "the flag was given".
_FLAG_ACTIONS = (argparse._StoreConstAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
                 argparse.BooleanOptionalAction)
_NO_ENV_ACTIONS = (argparse._HelpAction, argparse._VersionAction, argparse._CountAction,
                   argparse._AppendAction, argparse._AppendConstAction)


def env_var_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> str | None:
    """The variable that sets `action`, or None for positionals, --help and the like."""
    if not action.option_strings or isinstance(action, _NO_ENV_ACTIONS):
        return None
    longest = max(action.option_strings, key=len)
    return prefix + longest.lstrip("-").upper().replace("-", "_")


def _default_text(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, _FLAG_ACTIONS) and not isinstance(action, argparse.BooleanOptionalAction):
        return "off"
    default = action.default
    if default is None or default == []:
        return "unset"
    if default == "":
        return '""'
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default))
    return str(default)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: D; env NAME)` to every optional flag's help line. The description keeps
    its line breaks (module docstrings are written as paragraphs and usage examples)."""

    env_prefix = ENV_PREFIX

    def add_argument(self, action: argparse.Action) -> None:
        name = env_var_name(action, self.env_prefix)
        if name is not None and action.help is not argparse.SUPPRESS:
            # A copy: argparse prints no help line at all for a flag whose help is None, and the
            # parser's own action must keep its text for the next --help.
            note = f"(default: {_default_text(action)}; env {name})".replace("%", "%%")
            action = copy.copy(action)
            action.help = f"{action.help} {note}" if action.help else note
        super().add_argument(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose optional flags also read QWEN3_SERVE_* variables (see the
    module docstring), with defaults and variable names in --help."""

    def __init__(self, *args, env_prefix: str = ENV_PREFIX, **kwargs) -> None:
        self.env_prefix = env_prefix   # before super().__init__, which formats the --help action
        self._alias_of: dict[argparse.Action, argparse.Action] = {}
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_hidden_alias(self, action: argparse.Action, *spellings: str) -> None:
        """Old spellings of `action`'s flag: they set the same value, and so do their variables
        (the new variable wins when both are set), but --help shows neither."""
        alias = copy.copy(action)
        alias.option_strings = list(spellings)
        alias.help = alias.default = argparse.SUPPRESS
        alias.required = False
        self._add_action(alias)
        self._alias_of[alias] = action

    def _get_formatter(self) -> argparse.HelpFormatter:
        formatter = super()._get_formatter()
        if isinstance(formatter, _HelpFormatter):
            formatter.env_prefix = self.env_prefix
        return formatter

    def env_vars(self) -> dict[str, argparse.Action]:
        """Every variable this parser reads, with the action it sets."""
        return {name: a for a in self._actions if (name := env_var_name(a, self.env_prefix))}

    def parse_known_args(self, args=None, namespace=None):
        with self._environment_defaults():
            return super().parse_known_args(args, namespace)

    @contextlib.contextmanager
    def _environment_defaults(self) -> Iterator[None]:
        """Turns set variables into the defaults of their flags for one parse, then restores the
        code's defaults, so the parser stays reusable and --help shows the code's values."""
        saved = [(a, a.default, a.required) for a in self._actions]
        try:
            for name, action in self.env_vars().items():
                raw = os.environ.get(name)
                target = self._alias_of.get(action, action)
                if raw is None or (target is not action and env_var_name(target, self.env_prefix) in os.environ):
                    continue
                target.default = self._value_from_env(name, raw, target)
                target.required = False
            yield
        finally:
            for action, default, required in saved:
                action.default, action.required = default, required

    def _value_from_env(self, name: str, raw: str, action: argparse.Action):
        if isinstance(action, _FLAG_ACTIONS):
            word = raw.strip().lower()
            if word not in _TRUE | _FALSE:
                self.error(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")
            if isinstance(action, argparse.BooleanOptionalAction):
                return word in _TRUE
            return action.const if word in _TRUE else action.default
        try:
            if action.nargs in ("+", "*") or isinstance(action.nargs, int):
                values = [self._get_value(action, part) for part in raw.split()]
                for value in values:
                    self._check_value(action, value)
                return values
            value = self._get_value(action, raw)
            self._check_value(action, value)
            return value
        except argparse.ArgumentError as exc:
            self.error(f"{name}={raw!r}: {exc.message}")


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line (see `flag`)."""
    help: str
    name: str | None = None                   # unset: --field-name (--no-field-name for a bool that defaults on)
    aliases: tuple[str, ...] = ()             # old spellings, still accepted, hidden from --help
    choices: tuple[Any, ...] | None = None
    type: Callable[[str], Any] | None = None  # unset: the field's annotated type
    metavar: str | None = None
    group: str | None = None                  # the --help section it is listed under


def flag(default: Any = dataclasses.MISSING, *, help: str, **how: Any) -> Any:
    """A dataclass field that is also a command-line flag; `how` takes Flag's other fields.
    Without a default the flag is required."""
    return dataclasses.field(default=default, metadata={CLI_METADATA: Flag(help, **how)})


def add_config_arguments(parser: ArgumentParser, config_class: type,
                         group_descriptions: Mapping[str, str] | None = None) -> None:
    """One argument per flag() field of `config_class`, in field order; its value lands in
    args.<field name>."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        spec = field.metadata.get(CLI_METADATA)
        if spec is None:
            continue
        value_type = _value_type(config_class, field.name, hints[field.name])
        name = spec.name or ("--no-" if value_type is bool and field.default is True else "--") + \
            field.name.replace("_", "-")
        container = _argument_group(parser, spec.group, group_descriptions or {})
        action = container.add_argument(name, dest=field.name, help=spec.help,
                                        **_argument_options(field, spec, value_type))
        if spec.aliases:
            parser.add_hidden_alias(action, *spec.aliases)


def config_from_args(config_class: type[Config], args: argparse.Namespace, **overrides: Any) -> Config:
    """`config_class` from parsed flags: every flag() field from args, the others their defaults."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if CLI_METADATA in f.metadata}
    return config_class(**(values | overrides))


def _value_type(config_class: type, name: str, hint: Any) -> type:
    """int for `int` and `int | None`; a field of another shape needs Flag.type."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        hint = members[0] if len(members) == 1 else None
    if hint not in (bool, int, float, str):
        raise TypeError(f"{config_class.__name__}.{name}: a flag of type {hint!r} needs Flag.type")
    return hint


def _argument_options(field: dataclasses.Field, spec: Flag, value_type: type) -> dict[str, Any]:
    if value_type is bool:
        return {"action": "store_false" if field.default is True else "store_true"}
    options: dict[str, Any] = {"type": spec.type or value_type}
    if field.default is dataclasses.MISSING:
        options["required"] = True
    else:
        options["default"] = field.default
    if spec.choices is not None:
        options["choices"] = spec.choices
    if spec.metavar or spec.name:     # a spelling of its own names its value after it, not the field
        options["metavar"] = spec.metavar or spec.name.lstrip("-").upper().replace("-", "_")
    return options


def _argument_group(parser: ArgumentParser, title: str | None, descriptions: Mapping[str, str]):
    """The parser itself, or its group of that title (made on first use)."""
    if title is None:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title, descriptions.get(title))


def markdown_table(parser: ArgumentParser) -> str:
    """Every argument of `parser` as --help lists them: flag, default, variable, meaning."""
    rows = ["| flag | default | variable | meaning |", "| --- | --- | --- | --- |"]
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
            variable = env_var_name(action, parser.env_prefix)
            meaning = action.help or ""
            if action.choices is not None and not isinstance(action, _FLAG_ACTIONS):
                meaning += ("; " if meaning else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
            cells = (name, _default_text(action), f"`{variable}`" if variable else "", meaning)
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, the same in every long-running process."""
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    group.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                       help="json: one JSON object a line (ts, level, logger, msg, request_id, exc)")


def add_client_security_arguments(parser: argparse.ArgumentParser, prefix: str, peer: str, title: str,
                                  description: str) -> None:
    """The flags by which a process proves itself to the servers it calls (`peer` names them in the
    help): --{prefix}auth-token(-file) and --{prefix}tls-ca/-cert/-key. Check them after parsing
    with check_client_security_arguments."""
    group = parser.add_argument_group(title, description)
    group.add_argument(f"--{prefix}auth-token", default=None, help=f"bearer token to send to {peer}")
    group.add_argument(f"--{prefix}auth-token-file", default=None, help=f"file holding --{prefix}auth-token")
    group.add_argument(f"--{prefix}tls-ca", default=None, help=f"reach {peer} over TLS, trusting this CA")
    group.add_argument(f"--{prefix}tls-cert", default=None, help=f"client certificate, for {peer} requiring mTLS")
    group.add_argument(f"--{prefix}tls-key", default=None, help=f"private key of --{prefix}tls-cert")


def check_client_security_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str) -> None:
    """Refuses (parser.error) a client certificate without its key or the reverse."""
    attr = prefix.replace("-", "_")
    if bool(getattr(args, f"{attr}tls_cert")) != bool(getattr(args, f"{attr}tls_key")):
        parser.error(f"--{prefix}tls-cert and --{prefix}tls-key go together")


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable only from this machine. A name counts as
    loopback only when every address it resolves to is; one that does not resolve does not."""
    host = host.strip("[]")
    if host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def warn_if_exposed(host: str, port: int, *, has_token: bool, has_tls: bool, log: logging.Logger,
                    what: str = "this server") -> bool:
    """Logs a loud warning when `host` is not a loopback address and the server checks neither a
    bearer token nor a TLS client: then anyone who can reach the port can use it. Returns whether
    it warned."""
    if is_loopback(host) or has_token or has_tls:
        return False
    bar = "!" * 78
    log.warning("%s\n%s listens on %s:%d, reachable from other machines, WITHOUT authentication or TLS:\n"
                "anyone who can reach this port can use it. Set --auth-token-file (and --tls-cert/--tls-key),\n"
                "or listen on 127.0.0.1, unless a network policy or proxy in front of it does this job.\n%s",
                bar, what, host, port, bar)
    return True
