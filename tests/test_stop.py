"""StopMatcher: never emits any part of a stop string, whatever the deltas' boundaries."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from neuronpy.engine.stop import StopMatcher


def run(stops: Sequence[str], deltas: Sequence[str]) -> tuple[list[str], bool, StopMatcher]:
    """Push every delta (and flush if no stop); return the emitted pieces, stopped?, matcher."""
    matcher = StopMatcher(stops)
    pieces: list[str] = []
    stopped = False
    for delta in deltas:
        out, stopped = matcher.push(delta)
        pieces.append(out)
        if stopped:
            break
    if not stopped:
        pieces.append(matcher.flush())
    return pieces, matcher.stopped, matcher


def expected(stops: Sequence[str], text: str) -> tuple[str, bool]:
    """The text before the earliest occurrence of any stop string, and whether one occurs."""
    starts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(starts)], True) if starts else (text, False)


def splits(text: str, parts: int) -> list[list[str]]:
    """Every way to cut `text` into `parts` pieces (empty pieces allowed)."""
    out = []
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


def assert_never_leaks(stops: Sequence[str], deltas: Sequence[str]) -> None:
    text = "".join(deltas)
    pieces, stopped, _ = run(stops, deltas)
    want, want_stopped = expected(stops, text)
    assert "".join(pieces) == want, deltas
    assert stopped == want_stopped, deltas
    # No prefix of the output ever runs into a stop string, not even partly.
    for stop in stops:
        assert stop not in "".join(pieces)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_stop_split_every_possible_way(parts: int) -> None:
    for deltas in splits("hello STOP world", parts):
        assert_never_leaks(["STOP"], deltas)
        pieces, stopped, _ = run(["STOP"], deltas)
        assert stopped and "".join(pieces) == "hello "


def test_stop_one_character_per_delta() -> None:
    pieces, stopped, _ = run(["STOP"], list("hello STOP world"))
    assert stopped and "".join(pieces) == "hello "
    # Each character is held only while it could still start "STOP".
    assert pieces[:6] == list("hello ")


def test_no_stops_passes_text_straight_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.push("STOP") == ("STOP", False)
    assert matcher.flush() == ""


def test_pushes_after_a_stop_return_nothing() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("aSTOPb") == ("a", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""
    assert matcher.stopped


def test_partial_match_that_fails_is_emitted() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == ("go ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("RM") == ("STORM", False)
    assert matcher.push(" S") == (" ", False)
    assert matcher.flush() == "S"
    assert not matcher.stopped


def test_held_back_is_only_the_longest_possible_start() -> None:
    matcher = StopMatcher(["abcabd"])
    # "abcabd" could still start at the second "abc", not at the first.
    assert matcher.push("xabcabc") == ("xabc", False)
    assert matcher.push("abd") == ("", True)


def test_overlapping_stops_earliest_position_wins() -> None:
    for deltas in splits("xaby", 3):
        assert_never_leaks(["ab", "b"], deltas)
        assert_never_leaks(["b", "ab"], deltas)
    assert run(["b", "ab"], ["xab"])[0] == ["x"]


def test_stop_that_is_a_prefix_of_another() -> None:
    for stops in (["STOP", "STOPPER"], ["STOPPER", "STOP"]):
        for deltas in splits("a STOPPER b", 3):
            assert_never_leaks(stops, deltas)
        # The shorter stop ends the stream at once: no waiting to see if the longer follows.
        matcher = StopMatcher(stops)
        assert matcher.push("a STOP") == ("a ", True)


def test_later_shorter_stop_waits_for_an_earlier_longer_one() -> None:
    # "cd" is complete, but "abcde" (starting earlier) might still complete and would win.
    matcher = StopMatcher(["abcde", "cd"])
    assert matcher.push("zabcd") == ("z", False)
    assert matcher.push("e") == ("", True)
    matcher = StopMatcher(["abcde", "cd"])
    assert matcher.push("zabcd") == ("z", False)
    assert matcher.push("x") == ("ab", True)
    # At the end of the stream the complete one is cut at.
    matcher = StopMatcher(["abcde", "cd"])
    matcher.push("zabcd")
    assert matcher.flush() == "ab"
    assert matcher.stopped
    for deltas in splits("zabcde", 3):
        assert_never_leaks(["abcde", "cd"], deltas)
    for deltas in splits("zabcdx", 3):
        assert_never_leaks(["abcde", "cd"], deltas)


@pytest.mark.parametrize("stop", ["日本", "🙂🚀", "\n\n", "é\u0301", "</s>"])
def test_unicode_and_multi_character_stops(stop: str) -> None:
    text = f"ok 日🙂 {stop[:-1]}x {stop} tail"
    for deltas in splits(text, 3):
        assert_never_leaks([stop], deltas)
    pieces, stopped, _ = run([stop], [text])
    assert stopped and "".join(pieces) == f"ok 日🙂 {stop[:-1]}x "


def test_random_streams_match_the_text_before_the_first_stop() -> None:
    rng = random.Random(99)
    alphabet = "abAB 日🙂\n"
    for _ in range(500):
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        deltas = []
        i = 0
        while i < len(text):
            n = rng.randint(0, 5)
            deltas.append(text[i : i + n])
            i += n
        assert_never_leaks(stops, deltas)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def test_matched_names_the_stop_that_ended_the_text_however_it_was_split() -> None:
    text = "alpha beta END gamma STOP"
    for stops, expected in (
        (["STOP", "END"], "END"),  # the earliest in the text, not in the list
        (["zzz"], None),
        (["END g", "END"], "END"),  # two at one place: the shortest (it completes first)
    ):
        for cut in range(1, len(text)):
            matcher = StopMatcher(stops)
            out, stopped = matcher.push(text[:cut])
            if not stopped:
                more, stopped = matcher.push(text[cut:])
                out += more
            if not stopped:
                out += matcher.flush()
            assert matcher.matched == expected, (stops, cut)
            assert out == (text if expected is None else text[: text.index(expected)])
