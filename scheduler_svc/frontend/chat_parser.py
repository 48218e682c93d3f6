"""Streaming split of a Qwen3 chat turn's text into reasoning, content and complete tool calls.

The detokenizer hands over text piece by piece; `ChatOutputParser.feed` returns what each piece
completes, `finish` what is left when the turn ends. The model's text is read as Qwen3 writes it:
  - reasoning: `<think>` (at the very start of the turn, or already opened by the prompt, see
    ChatPrompt.reasoning_open) up to `</think>`. Newlines right after `<think>` and around
    `</think>` are layout, as the Qwen3 template treats them (it strips them when it renders a
    turn back), and are dropped.
  - tool calls (when the prompt offered tools): `<tool_call>` JSON `</tool_call>`, the JSON an
    object with a string "name" and an object "arguments". A block is reported once complete,
    as a ToolCall whose arguments_json is the arguments re-serialized. A block whose JSON is
    malformed, or that never closes, is text: the client sees exactly what the model wrote.
    Newlines between content and a call, and between calls, are separators and are dropped.
  - content: everything else.
The server reports FINISH_REASON_TOOL_CALLS for a turn that stopped (EOS or a stop token) after
`num_tool_calls` > 0, as vLLM does; a turn cut by max_tokens stays LENGTH.
Markers may arrive split over pieces ("<tool" then "_call>"): a suffix of the text that could
still become a marker is held back until the next piece decides it. Concatenating the reasoning
and content of every feed and the finish gives back the model's text, less the markers, the
parsed blocks and the layout newlines.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from common import strict_json
from common.strict_json import JsonProblem
from scheduler_svc.frontend.chat import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START, ToolCall

_REASONING, _CONTENT, _TOOL_CALL = "reasoning", "content", "tool_call"


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text or self.tool_calls)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    def __init__(self, *, reasoning_open: bool = False, parse_tool_calls: bool = False,
                 new_id: Callable[[], str] = new_tool_call_id) -> None:
        """`reasoning_open`: the prompt opened a <think> block, so the text starts inside it.
        `parse_tool_calls`: tools were offered; otherwise <tool_call> blocks are content."""
        self._state = _REASONING if reasoning_open else _CONTENT
        self._parse_tool_calls = parse_tool_calls
        self._new_id = new_id
        self._held = ""              # a suffix that may be the start of a marker
        self._newlines = ""          # trailing newlines of the state's text: layout if a marker follows
        self._call_body = ""         # text inside the current <tool_call> block
        self._before_call = ""       # the newlines dropped before it, restored if the block is text
        self._at_start = True        # nothing but newlines so far: a <think> here opens reasoning
        self._strip_newlines = True  # drop newlines until the next other character (layout)
        self.num_tool_calls = 0

    def feed(self, piece: str) -> ChatDelta:
        """Attributes a new piece of text; returns what is now certain."""
        delta = ChatDelta()
        text, self._held = self._held + piece, ""
        while text:
            text = self._step(text, delta)
        return delta

    def finish(self) -> ChatDelta:
        """Ends the turn: held text is released as what it is, an unclosed tool-call block as text."""
        delta = ChatDelta()
        held, self._held = self._held, ""
        if self._state == _TOOL_CALL:
            self._emit(delta, _CONTENT, self._before_call + TOOL_CALL_START + self._call_body + held)
            self._state, self._call_body = _CONTENT, ""
        else:
            self._emit(delta, self._state, self._newlines + held)
        self._newlines = ""
        return delta

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def _markers(self) -> tuple[str, ...]:
        if self._state == _REASONING:
            return (THINK_END,)
        if self._state == _TOOL_CALL:
            return (TOOL_CALL_END,)
        markers = (TOOL_CALL_START,) if self._parse_tool_calls else ()
        return markers + (THINK_START,) if self._at_start else markers

    def _step(self, text: str, delta: ChatDelta) -> str:
        """Consumes a prefix of `text` (holding back a possible marker start); returns the rest."""
        markers = self._markers()
        at, marker = _first_marker(text, markers)
        if marker == THINK_START and text[:at].strip("\n"):   # <think> opens reasoning only at the start
            markers = tuple(m for m in markers if m != THINK_START)
            at, marker = _first_marker(text, markers)
        if marker is None:
            keep = _partial_marker_start(text, markers)
            self._take(delta, text[:keep])
            self._held = text[keep:]
            return ""
        self._take(delta, text[:at])
        self._enter(marker, delta)
        return text[at + len(marker):]

    def _take(self, delta: ChatDelta, text: str) -> None:
        """Text of the current state that comes before any marker."""
        if self._state == _TOOL_CALL:
            self._call_body += text
            return
        if self._strip_newlines:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_newlines = False
        self._at_start = False
        body = text.rstrip("\n")
        if body:
            self._emit(delta, self._state, self._newlines + body)
            self._newlines = ""
        self._newlines += text[len(body):]

    def _enter(self, marker: str, delta: ChatDelta) -> None:
        self._at_start = False
        newlines, self._newlines = self._newlines, ""   # newlines before a marker are layout
        if marker == THINK_START:
            self._state, self._strip_newlines = _REASONING, True
        elif marker == THINK_END:
            self._state, self._strip_newlines = _CONTENT, True
        elif marker == TOOL_CALL_START:
            self._state, self._call_body, self._before_call = _TOOL_CALL, "", newlines
        else:
            call = self._parse_call(self._call_body)
            if call is None:
                self._emit(delta, _CONTENT, self._before_call + TOOL_CALL_START + self._call_body + TOOL_CALL_END)
            else:
                delta.tool_calls.append(call)
                self.num_tool_calls += 1
            self._state, self._call_body, self._strip_newlines = _CONTENT, "", True

    @staticmethod
    def _emit(delta: ChatDelta, state: str, text: str) -> None:
        if state == _REASONING:
            delta.reasoning += text
        else:
            delta.text += text

    def _parse_call(self, body: str) -> ToolCall | None:
        """The call a block's JSON makes, or None (the block stays text). The JSON is read as RFC
        8259 has it (strict_json): NaN, Infinity or a number past a float's range would come back
        as arguments_json no client's JSON parser reads; nesting past the parser's recursion, or
        an integer too long to convert, is a malformed block too, never the call's error."""
        try:
            value = strict_json.loads(body)
        except JsonProblem:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        if strict_json.utf8_safe(value["name"]) != value["name"]:   # a lone surrogate (a \ud800 escape) names no tool
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):   # some models write the arguments as a JSON string
            try:
                arguments = strict_json.loads(arguments)
            except JsonProblem:
                return None
        if not isinstance(arguments, dict):
            return None
        # A lone surrogate in a string (JSON can spell one as \ud800; UTF-8, and so the proto's
        # string, cannot carry it) is written back as that escape: the same JSON value.
        arguments_json = strict_json.utf8_safe(json.dumps(arguments, ensure_ascii=False))
        return ToolCall(id=self._new_id(), name=value["name"], arguments_json=arguments_json)


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best_at, best = len(text), None
    for marker in markers:
        at = text.find(marker)
        if at != -1 and at < best_at:
            best_at, best = at, marker
    return best_at, best


def _partial_marker_start(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest suffix of `text` that is a proper prefix of a marker begins (len(text) if none)."""
    longest = max((len(m) for m in markers), default=1) - 1
    for start in range(max(len(text) - longest, 0), len(text)):
        suffix = text[start:]
        if any(m.startswith(suffix) for m in markers):
            return start
    return len(text)
