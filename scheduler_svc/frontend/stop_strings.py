"""Stop strings over streamed text: emit what can no longer become part of a stop string, hold the rest.

A stop string may arrive split over several pieces ("<|" then "end|>"), so the text's longest suffix that
is still the beginning of some stop string is held back until the next piece decides it. The first stop
string to complete wins (the earliest in the text when one piece completes several, so overlapping stops
resolve to the one that starts first); the output ends right before it and everything after is dropped.
Pieces fed with `match=False` (a sample's first min_tokens tokens, as vLLM has it) are held back the same
way but end nothing: a stop string that ends in them never matches, one that only starts in them can.
"""
from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(stops))
        if any(not stop for stop in self.stops):
            raise ValueError("stop strings must be non-empty")
        self.matched: str | None = None   # the stop string that ended the text, once one has
        self._held = ""                   # never contains a whole stop string that may still match
        self._blind = 0                   # how many of the held characters came with match=False
        self._first_chars = frozenset(stop[0] for stop in self.stops)
        self._max_held = max((len(stop) for stop in self.stops), default=1) - 1

    def feed(self, piece: str, match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has matched). After a match every
        later piece is dropped. With match=False no stop string ending in `piece` matches."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        if match:
            match_at, stop = self._earliest_match(text, self._blind)
            if stop is not None:
                self.matched, self._held = stop, ""
                return text[:match_at], True
        hold_from = self._start_of_partial_match(text)
        self._held = text[hold_from:]
        # The text's first `_blind` characters came blind (and now, with match=False, all of it).
        self._blind = max(self._blind - hold_from, 0) if match else len(self._held)
        return text[:hold_from], False

    def flush(self) -> str:
        """Text held back when the sequence ends without a match: it will never complete a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str, blind: int) -> tuple[int, str | None]:
        """The earliest stop string in `text` that ends past its first `blind` characters."""
        best_at, best = len(text), None
        for stop in self.stops:
            # Search only where a match can end inside the window; finding past best_at is useless.
            at = text.find(stop, max(blind - len(stop) + 1, 0), best_at + len(stop) - 1)
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
