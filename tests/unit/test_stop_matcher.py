from __future__ import annotations

from inference.engines.text import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_it_stops_before_a_stop_string_split_across_tokens():
    assert feed_all(StopMatcher(["END"]), ["Hello E", "N", "D and more"]) == ("Hello ", True)


def test_it_releases_held_text_that_was_not_a_stop():
    matcher = StopMatcher(["END"])
    assert matcher.feed("Hello E") == ("Hello ", False)
    assert matcher.feed("gg") == ("Egg", False)


def test_it_stops_at_the_earliest_of_several_stops():
    assert feed_all(StopMatcher(["b", "a"]), ["xxab"]) == ("xx", True)


def test_it_passes_everything_without_stops():
    assert feed_all(StopMatcher([]), ["a", "b"]) == ("ab", False)


def test_flush_returns_a_held_prefix_at_the_end():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.flush() == "ST"
