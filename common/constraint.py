"""Structured-output constraints: what a request may ask its output to match, and the grammar of each.

A `Constraint` is a kind and its text: a JSON schema, a regex (the whole output fullmatches it),
an EBNF grammar as xgrammar reads it (GBNF: `root ::= ...`), json_object (any JSON object), or an
xgrammar structural tag (the frontend builds one from a chat request's tools, see
scheduler_svc/chat.py). `to_grammar` turns it into an xgrammar `Grammar` without a tokenizer:
cheap (no token masks), so the frontend calls it to refuse a bad constraint with INVALID_ARGUMENT
before the request is scheduled, and the worker's compiler (worker_svc/layers/grammar.py) calls it
before computing the masks. A bad constraint raises `GrammarError` (a ValueError) naming the kind
and the problem, never anything else.

Guarantees of the grammars built here, for JSON (json_schema, json_object, tool-call arguments):
  - compact: no whitespace between JSON tokens (separators "," and ":"), as vLLM's
    disable-any-whitespace. A grammar that allows whitespace lets a weak or random model emit
    newlines until max_tokens; xgrammar's default allows unbounded whitespace. Tool-call
    arguments allow at most one whitespace character between tokens (Qwen3 writes `", "`).
  - RFC 8259 strings: `json.loads` (strict) parses every output. xgrammar 0.2.9 emits, for strings
    with minLength/maxLength, a character class `[^"\\\r\n]` that lets raw control characters
    (U+0000..U+001F) through and forbids escapes; `_fix_counted_strings` replaces it with JSON's
    own string character (any unescaped character but controls, `"` and `\\`, or one escape).
  - strict objects: properties the schema does not declare are not generated (xgrammar's
    strict_mode, vLLM's default), so an object ends once its declared properties are written.
Why xgrammar rather than llguidance: docs/STRUCTURED_OUTPUT.md (measured by
bench/structured_output_choice.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json_schema", "regex", "grammar", "json_object", "structural_tag")
# Whitespace characters allowed between the JSON tokens of tool-call arguments.
TOOL_ARGUMENTS_MAX_WHITESPACE = 1

# xgrammar's character of a length-bounded JSON string (see the module docstring) and JSON's own:
# an unescaped character other than controls, quote and backslash, or one escape sequence. A
# \u escape of a UTF-16 surrogate is left out: a pair of them decodes to one character, so a
# grammar counting escapes would let a string shorter than minLength through.
_XGRAMMAR_COUNTED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = (
    r'([^\0-\x1f\"\\] | "\\" ([\"\\/bfnrt] | "u" ([0-9A-Ca-cE-Fe-f] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f]'
    r' | [Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f])))'
)
# xgrammar prefixes its C++ errors with "[time] /path/file.cc:line: " (and some with a failed
# check's text); the caller wants the problem.
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that cannot be compiled. `kind` names the constraint field (json_schema, regex,
    ...) so the frontend can name it in its INVALID_ARGUMENT."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(f"invalid {kind}: {problem}")
        self.kind, self.problem = kind, problem


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str
    text: str = ""   # empty for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError("constraint", f"unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.kind != "json_object" and not self.text.strip():
            raise GrammarError(self.kind, "empty")


def to_grammar(constraint: Constraint) -> "xgrammar.Grammar":
    """The xgrammar Grammar of `constraint` (no tokenizer needed). Raises GrammarError."""
    import xgrammar as xgr

    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_schema":
            _parse_json(kind, text)
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
            return _fix_counted_strings(grammar)
        if kind == "json_object":
            # Non-strict: `{"type": "object"}` in strict mode would admit only {}.
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                   separators=(",", ":"), strict_mode=False)
            return _fix_counted_strings(grammar)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        _parse_json(kind, text)
        return _fix_counted_strings(xgr.Grammar.from_structural_tag(text))
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(kind, _native_message(exc)) from None


def _parse_json(kind: str, text: str) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(kind, f"not valid JSON: {exc}") from None


def _fix_counted_strings(grammar: "xgrammar.Grammar") -> "xgrammar.Grammar":
    import xgrammar as xgr

    ebnf = str(grammar)
    if _XGRAMMAR_COUNTED_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_XGRAMMAR_COUNTED_CHAR, _JSON_STRING_CHAR))


def _native_message(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = _NATIVE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return message.removeprefix("Invalid structural tag error: ")
