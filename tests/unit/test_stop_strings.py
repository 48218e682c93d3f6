"""StopStringMatcher against a brute-force reference that re-searches the whole text after every piece."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.frontend.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
    return out, stopped


def reference(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The output text and whether it stopped: the first piece that completes any stop string ends the
    text at the earliest such match."""
    text = ""
    for piece in pieces:
        text += piece
        starts = [text.find(stop) for stop in stops if stop in text]
        if starts:
            return text[: min(starts)], True
    return text, False


def longest_partial_suffix(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for stop in stops if len(stop) > k and stop.startswith(text[-k:])), default=0)


# A three-letter alphabet makes partial matches, overlaps and repeats common.
pieces_st = st.lists(st.text(alphabet="abc", max_size=5), max_size=12)
stops_st = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4)


@settings(max_examples=200, deadline=None)
@given(pieces=pieces_st, stops=stops_st)
def test_matches_reference_and_holds_back_only_what_could_still_match(pieces, stops):
    matcher = StopStringMatcher(stops)
    emitted, seen, stopped = "", "", False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted += text
        if stopped:
            break
        seen += piece
        # Everything is out except exactly the longest suffix that could begin a stop string.
        assert emitted == seen[: len(seen) - longest_partial_suffix(seen, stops)]
    expected_text, expected_stopped = reference(pieces, stops)
    assert stopped == (matcher.matched is not None) == expected_stopped
    assert emitted + ("" if expected_stopped else matcher.flush()) == expected_text


def test_stop_spanning_three_pieces_is_cut_before_it():
    matcher = StopStringMatcher(["<|end|>"])
    assert feed_all(matcher, ["Hello <", "|en", "d|> and more"]) == (["Hello ", "", ""], True)
    assert matcher.matched == "<|end|>"
    assert matcher.feed("later text") == ("", True)


def test_partial_match_that_fails_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["go ST", "P?", "x"]) == (["go ", "STP?", "x"], False)


def test_held_text_is_flushed_when_the_stream_ends():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.flush() == "</ans"


def test_overlapping_stops_completed_by_one_piece_earliest_start_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert feed_all(matcher, ["xab", "cd"]) == (["x", ""], True)
    assert matcher.matched == "abcd"


def test_overlapping_stops_first_completed_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    # "ab" is held (it could begin "abcd"), then "c" completes "bc" before "abcd" could complete.
    assert feed_all(matcher, ["xab", "c", "d"]) == (["x", "a", ""], True)
    assert matcher.matched == "bc"


def test_earliest_of_several_matches_in_one_piece():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo w"


def test_stop_at_the_very_start_emits_nothing():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("\n\nrest") == ("", True)


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher([])
    assert feed_all(matcher, ["a", "", "bc"]) == (["a", "", "bc"], False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        StopStringMatcher(["ok", ""])


def blind_reference(pieces: list[str], stops: list[str], blind_pieces: int) -> tuple[str, bool]:
    """As `reference`, the first `blind_pieces` pieces matching nothing (a sample's first min_tokens
    tokens): the first later piece that completes a stop string ending past them ends the text at the
    earliest such match, wherever it starts."""
    text = "".join(pieces[:blind_pieces])
    blind = len(text)
    for piece in pieces[blind_pieces:]:
        text += piece
        starts = [at for stop in stops for at in range(len(text) - len(stop) + 1)
                  if text.startswith(stop, at) and at + len(stop) > blind]
        if starts:
            return text[: min(starts)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(pieces=pieces_st, stops=stops_st, blind_pieces=st.integers(0, 12))
def test_pieces_fed_blind_end_nothing_and_a_stop_ending_after_them_matches_wherever_it_starts(pieces, stops,
                                                                                             blind_pieces):
    """min_tokens as vLLM has it for stop strings: the first pieces match nothing, but what they leave held can
    start a stop string that a later piece completes."""
    matcher = StopStringMatcher(stops)
    emitted, stopped = "", False
    for i, piece in enumerate(pieces):
        text, stopped = matcher.feed(piece, match=i >= blind_pieces)
        emitted += text
        if stopped:
            break
    expected_text, expected_stopped = blind_reference(pieces, stops, blind_pieces)
    assert stopped == (matcher.matched is not None) == expected_stopped
    assert emitted + ("" if expected_stopped else matcher.flush()) == expected_text


def test_a_stop_string_held_from_the_blind_pieces_does_not_match_later():
    """Stops "abc" and "b": "ab" arrives blind and is held (it may begin "abc"); its "b" ended there, so the
    next piece "x" matches nothing and releases it."""
    matcher = StopStringMatcher(["abc", "b"])
    assert matcher.feed("ab", match=False) == ("", False)
    assert matcher.feed("x") == ("abx", False)
    matcher = StopStringMatcher(["abc", "b"])
    matcher.feed("ab", match=False)
    assert matcher.feed("c") == ("", True) and matcher.matched == "abc"
