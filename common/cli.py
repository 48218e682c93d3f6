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

It also holds what the servers share about where they listen: `is_loopback` and
`warn_if_exposed` (a server reachable from other machines without a token or TLS says so loudly
at start-up).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator

from common.logging_setup import LOG_FORMATS

ENV_PREFIX = "QWEN3_SERVE_"

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
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

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
                if raw is not None:
                    action.default = self._value_from_env(name, raw, action)
                    action.required = False
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
