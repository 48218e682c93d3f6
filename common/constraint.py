"""Structured-output constraints: what a request may ask its output to match, and the grammar of each.

A `Constraint` is a kind and its text: a JSON schema, a regex (the whole output fullmatches it),
an EBNF grammar as xgrammar reads it (GBNF: `root ::= ...`), json_object (any JSON object), or an
xgrammar structural tag (the frontend builds one from a chat request's tools, see
scheduler_svc/frontend/chat.py). `to_grammar` turns it into an xgrammar `Grammar` without a tokenizer:
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
    (U+0000..U+001F) through and forbids escapes; `to_grammar` replaces it with JSON's own string
    character (any unescaped character but controls, `"` and `\\`, or one escape).
  - strict objects: properties the schema does not declare are not generated (xgrammar's
    strict_mode, vLLM's default), so an object ends once its declared properties are written.
  - enforced, or refused: xgrammar 0.2.9 ignores some keywords (allOf of several schemas, not,
    if/then/else, uniqueItems, contains, dependentRequired, dependentSchemas, a $ref to another
    document), so an output would not validate; `enforceable_schema` refuses them naming the
    keyword, and an empty anyOf, oneOf or type list, which no value validates against. A required
    property the object does not declare would never be written under strict objects: it is
    declared, with additionalProperties' schema (any value by default).
For every kind, the text is valid UTF-8: xgrammar 0.2.9 lets a negated character class (JSON's
string character, `[^a]`, ...) and its expansion of the regex `.` match the 3-byte encoding of a
UTF-16 surrogate (ED A0..BF xx), which is no character; the detokenizer renders it as three
U+FFFD, which also breaks maxLength. `_exclude_surrogates` takes U+D800..U+DFFF out of those
classes. Not covered: character classes inside a JSON schema's "pattern" (xgrammar keeps the
pattern as a regex it matches itself). A `\uD83D\uDE00` escape pair (how JavaScript and JSON spell
a character past U+FFFF) in a regex, a grammar or a schema's "pattern" is the one character it
spells (xgrammar would read two lone surrogates: six bytes that are no text), and a lone surrogate
escape is refused, naming where it stands (`_surrogate_escapes`).
Why xgrammar rather than llguidance, measured: docs/STRUCTURED_OUTPUT.md.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import strict_json
from common.json_schema import SCHEMA_KEYWORDS, SCHEMA_VALUES, subschemas

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
# xgrammar's expansion of the regex `.`, and the same without surrogates.
_ANY_CHAR = r"[\0-\U0010ffff]"
_ANY_SCALAR = r"[\0-\ud7ff\ue000-\U0010ffff]"
_SURROGATES = r"\ud800-\udfff"
# xgrammar prefixes its C++ errors with "[time] /path/file.cc:line: " (and some with a failed
# check's text); the caller wants the problem.
# Keywords xgrammar 0.2.9 compiles as if they were absent (see the module docstring).
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
                     "dependentSchemas", "dependencies")
# Keywords whose empty list no value validates against.
_EMPTY_MATCHES_NOTHING = ("anyOf", "oneOf", "type")
# A problem's text is cut to this: a status message travels in HTTP/2 trailers (16 KiB at most).
_MAX_PROBLEM_CHARS = 1000
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that cannot be compiled. `kind` names the constraint field (json_schema, regex,
    ...) so the frontend can name it in its INVALID_ARGUMENT."""

    def __init__(self, kind: str, problem: str) -> None:
        if len(problem) > _MAX_PROBLEM_CHARS:   # xgrammar may quote the whole constraint back
            problem = problem[:_MAX_PROBLEM_CHARS] + "..."
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
            text = json.dumps(enforceable_schema(_parse_json(kind, text), kind))
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
        elif kind == "json_object":
            # Non-strict: `{"type": "object"}` in strict mode would admit only {}.
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                   separators=(",", ":"), strict_mode=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(_surrogate_escapes(kind, text))
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(_surrogate_escapes(kind, text))
        else:
            text = json.dumps(_enforceable_tag(_parse_json(kind, text), kind))
            grammar = xgr.Grammar.from_structural_tag(text)
        ebnf = str(grammar)
        if kind not in ("regex", "grammar"):   # a user's own grammar means what it says
            ebnf = ebnf.replace(_XGRAMMAR_COUNTED_CHAR, _JSON_STRING_CHAR)
        ebnf = _exclude_surrogates(ebnf)
        return grammar if ebnf == str(grammar) else xgr.Grammar.from_ebnf(ebnf)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(kind, _native_message(exc)) from None


def _parse_json(kind: str, text: str):
    try:
        return strict_json.loads(text)
    except strict_json.JsonProblem as exc:
        raise GrammarError(kind, str(exc)) from None


def enforceable_schema(schema, kind: str = "json_schema"):
    """`schema` (parsed JSON) as xgrammar can hold an output to it: each required property the
    object does not declare declared (see the module docstring). Raises GrammarError naming a
    keyword xgrammar would ignore, or a required property additionalProperties false forbids."""
    try:
        return _enforceable(schema, kind, "#")
    except RecursionError:
        raise GrammarError(kind, "nested too deeply") from None


def _enforceable(schema, kind: str, path: str):
    if not isinstance(schema, dict):
        return schema
    ignored = [key for key in _IGNORED_KEYWORDS if key in schema]
    if schema.get("uniqueItems") is True:
        ignored.append("uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        ignored.append("allOf")     # xgrammar takes one schema in allOf, not an intersection of several
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        ignored.append("$ref")      # to another document, which is never fetched
    if ignored:
        raise GrammarError(kind, f"{ignored[0]!r} at {path} is not supported: structured output could not hold "
                                 f"the output to it")
    # No value validates against an empty anyOf, oneOf or type list; xgrammar 0.2.9 reads them as
    # no constraint at all, or (a property's anyOf) writes no value: `{"a":}`, which is no JSON.
    empty = next((key for key in _EMPTY_MATCHES_NOTHING if schema.get(key) == []), None)
    if empty is not None:
        raise GrammarError(kind, f"{empty!r} at {path} is an empty list: no output can validate")
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _surrogate_escapes(kind, out["pattern"], f"{path}/pattern")
    for key in SCHEMA_KEYWORDS:     # the ignored ones (not, if, ...) were refused above
        value = out.get(key)
        if key in SCHEMA_VALUES:    # one schema (draft 7's list of items passes as it is)
            if key in out:
                out[key] = _enforceable(value, kind, f"{path}/{key}")
        elif children := subschemas(key, value):
            walked = [_enforceable(sub, kind, f"{path}/{key}/{step}") for step, sub in children]
            out[key] = dict(zip(value, walked)) if isinstance(value, dict) else walked
    return _declare_required(out, kind, path)


def _declare_required(schema: dict, kind: str, path: str) -> dict:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if not missing:
        return schema
    extra = schema.get("additionalProperties", True)
    if extra is False:
        raise GrammarError(kind, f"{path} requires property {missing[0]!r}, which its additionalProperties false "
                                 f"forbids: no output can validate")
    value = extra if isinstance(extra, dict) else {}
    return {**schema, "properties": {**properties, **{name: value for name in missing}}}


def _enforceable_tag(value, kind: str):
    """A structural tag with enforceable_schema applied to each of its json_schema contents."""
    if isinstance(value, list):
        return [_enforceable_tag(item, kind) for item in value]
    if not isinstance(value, dict):
        return value
    if value.get("type") == "json_schema" and "json_schema" in value:
        return {**value, "json_schema": enforceable_schema(value["json_schema"], kind)}
    return {key: _enforceable_tag(item, kind) for key, item in value.items()}


_U_ESCAPE = re.compile(r"\\u([0-9A-Fa-f]{4})")


def _surrogate_escapes(kind: str, text: str, where: str = "") -> str:
    """`text` (a regex or an EBNF grammar) with each `\\uHHHH` escape pair of a high and a low UTF-16
    surrogate written as the one character it spells (no regex or grammar syntax uses a character past
    U+FFFF, and xgrammar's schema patterns read no `\\U` escape). Raises GrammarError for a lone
    surrogate escape. An escaped backslash (`\\\\u...`) is no escape."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] != "\\":
            j = text.find("\\", i)
            j = n if j < 0 else j
            out.append(text[i:j])
            i = j
            continue
        unit = _U_ESCAPE.match(text, i)
        if unit is None:                     # another escape: copy it and the character it escapes
            out.append(text[i:i + 2])
            i += 2
            continue
        code = int(unit.group(1), 16)
        if 0xD800 <= code <= 0xDBFF and (low := _U_ESCAPE.match(text, unit.end())) \
                and 0xDC00 <= int(low.group(1), 16) <= 0xDFFF:
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + int(low.group(1), 16) - 0xDC00))
            i = low.end()
        elif 0xD800 <= code <= 0xDFFF:
            at = f" in {where}" if where else ""
            raise GrammarError(kind, f"{unit.group(0)} at character {i}{at} is a lone UTF-16 surrogate, which no "
                                     f"text contains: write the character, or its pair of surrogate escapes")
        else:
            out.append(unit.group(0))
            i = unit.end()
    return "".join(out)


def _exclude_surrogates(ebnf: str) -> str:
    """`ebnf` with U+D800..U+DFFF removed from every negated character class and from the
    any-character class, outside string literals (and so outside Regex("...") patterns)."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch == '"':                        # a string literal: copy through its closing quote
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif ch == "[":                      # a character class: find its closing bracket
            j = i + 1
            while j < n and ebnf[j] != "]":
                j += 2 if ebnf[j] == "\\" else 1
            cls = ebnf[i:j + 1]
            if cls == _ANY_CHAR:
                cls = _ANY_SCALAR
            elif cls.startswith("[^"):
                cls = "[^" + _SURROGATES + cls[2:]
            out.append(cls)
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _native_message(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    message = _NATIVE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return message.removeprefix("Invalid structural tag error: ")
