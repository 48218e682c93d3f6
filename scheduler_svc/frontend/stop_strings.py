"""Stop strings over streamed text: emit what can no longer become part of a stop string, hold the rest.

A stop string may arrive split over several pieces ("<|" then "end|>"), so the text's longest suffix that
is still the beginning of some stop string is held back until the next piece decides it. The first stop
string to complete wins (the earliest in the text when one piece completes several, so overlapping stops
resolve to the one that starts first); the output ends right before it and everything after is dropped.
"""
from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(stops))
        if any(not stop for stop in self.stops):
            raise ValueError("stop strings must be non-empty")
        self.matched: str | None = None   # the stop string that ended the text, once one has
        self._held = ""                   # never contains a whole stop string
        self._first_chars = frozenset(stop[0] for stop in self.stops)
        self._max_held = max((len(stop) for stop in self.stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has matched). After a match every
        later piece is dropped."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        match_at, match = self._earliest_match(text)
        if match is not None:
            self.matched, self._held = match, ""
            return text[:match_at], True
        hold_from = self._start_of_partial_match(text)
        self._held = text[hold_from:]
        return text[:hold_from], False

    def flush(self) -> str:
        """Text held back when the sequence ends without a match: it will never complete a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str | None]:
        best_at, best = len(text), None
        for stop in self.stops:
            # Search only where a match can end inside the window; finding past best_at is useless.
            at = text.find(stop, 0, best_at + len(stop) - 1)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _start_of_partial_match(self, text: str) -> int:
        """Index where the longest suffix of `text` that is a proper prefix of a stop string begins
        (len(text) when none is)."""
        for start in range(max(len(text) - self._max_held, 0), len(text)):
            if text[start] in self._first_chars:
                suffix = text[start:]
                if any(stop.startswith(suffix) for stop in self.stops):
                    return start
        return len(text)
