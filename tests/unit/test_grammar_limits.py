"""Issue 35: a schema `pattern` whose grammar stalls llama.cpp's sampler is refused before any
work. `^(a?){1000}$` passed every other limit and held the model for more than 600 s: libllama
keeps a parse stack in each copy of a repeated part that can match nothing and walks every parse
of every token it rejects (the figures are in inference/web/common/grammar_limits.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hypnos_site.config import LimitsConfig
from hypnos_site.errors import InvalidRequest
from inference.web.common.grammar_limits import check_schema, check_tools
from inference.web.common.grammar_patterns import pattern_stall

# Repeated parts that can match nothing, flat runs of them, and overlapping alternatives.
STALLING = {
    "(a?){1000}, the finding": "^(a?){1000}$",
    "(a*){1000}": "^(a*){1000}$",
    "((a?)?){1000}": "^((a?)?){1000}$",
    "(a|b?){1000}": "^(a|b?){1000}$",
    "a? written 1000 times": "^" + "a?" * 1000 + "$",
    "nested ((a?){30}){30}": "^((a?){30}){30}$",
    "(a?){5}": "^(a?){5}$",
    "(.?){4}, 54 ms a token": "^(.?){4}$",
    "four overlapping alternatives, 60 ms": "^([a-z]|[a-z]|[a-z]|[a-z])+$",
    "two overlapping alternatives 30 times, > 40 s": "^([ -~]|[ -~]){0,30}$",
    "three overlapping alternatives 10 times, 23 s": "^([a-z]|[a-z]|[a-z]){0,10}$",
    "1000 alternatives at one point": "^(" + "|".join(f"w{i}" for i in range(1000)) + ")$",
}
STATES = "AL|AK|AZ|AR|CA|CO|CT|DE|FL|GA|HI|ID|IL|IN|IA|KS|KY|LA|ME|MD|MA|MI|MN|MS|MO|MT|NE|NV|NH|NJ|NM|NY|NC"
ORDINARY = {
    "date": r"^\d{4}-\d{2}-\d{2}$",
    "date in classes": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
    "word": "^[a-z]{1,20}$",
    "phone number": r"^\d{3}-\d{4}$",
    "uuid": "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "repeated words": "^(foo|bar)+$",
    "e-mail": r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$",
    "e-mail, labels": r"^[a-z0-9]+([._-][a-z0-9]+)*@([a-z0-9]+(-[a-z0-9]+)*\.)+[a-z]{2,}$",
    "ipv4": r"^((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)$",
    "international phone": r"^\+?1?[- ]?\(?[0-9]{3}\)?[- ]?[0-9]{3}[- ]?[0-9]{4}$",
    "time": "^([01]?[0-9]|2[0-3]):[0-5][0-9]$",
    "url": "^(https?://)?([a-z0-9-]+\\.)+[a-z]{2,}(/[^ ]*)?$",
    "number": r"^-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?$",
    "hex colour": "^#?([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$",
    "any text up to 100": "^.{0,100}$",
    "words and optional spaces": "^([a-z]+ ?)+$",
    "state codes, comma separated": f"^({STATES})(,({STATES}))*$",
    "1000 letters": "^[a-z]{1,1000}$",
    "a long literal": "^" + "abcdefghij" * 300 + "$",
}


def string_schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}


@pytest.mark.parametrize("case", list(STALLING))
def test_it_refuses_a_pattern_whose_grammar_stalls_the_sampler(case: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_schema(string_schema(STALLING[case]), LimitsConfig(), "response_format")
    assert refused.value.param == "response_format"
    assert "schema.properties.code has the pattern" in refused.value.message
    assert "llama.cpp's sampler" in refused.value.message


@pytest.mark.parametrize("case", list(ORDINARY))
def test_it_keeps_ordinary_patterns(case: str) -> None:
    assert pattern_stall(ORDINARY[case]) is None
    check_schema(string_schema(ORDINARY[case]), LimitsConfig(), "response_format")


def test_it_says_how_many_stacks_the_finding_keeps() -> None:
    assert pattern_stall("^(a?){1000}$") == (
        "whose grammar keeps 1000 parse stacks alive at one point (above 256): "
        "llama.cpp's sampler would walk each for every token"
    )


def test_it_draws_the_line_where_a_token_passes_50_ms() -> None:
    # Measured: (.?){3} 27 ms a token, (.?){4} 54 ms; three overlapping alternatives 17 ms, four 60 ms.
    assert pattern_stall("^(.?){3}$") is None
    assert "16 parses of two characters" in (pattern_stall("^(.?){4}$") or "")
    assert pattern_stall("^([a-z]|[a-z]|[a-z])+$") is None
    assert "16 parses of two characters" in (pattern_stall("^([a-z]|[a-z]|[a-z]|[a-z])+$") or "")


def test_a_bounded_run_of_an_ambiguous_part_is_refused_and_an_unbounded_one_kept() -> None:
    """A token longer than a bounded run is rejected only after every parse of the run (8
    copies of two overlapping classes: 0.46 s a token); a loop rejects only at a character
    outside it (the same part unbounded: 29 ms)."""
    assert "4^8 parses" in (pattern_stall("^([ -~]|[ -~]){0,8}$") or "")
    assert pattern_stall("^([ -~]|[ -~])+$") is None
    assert pattern_stall("^[ -~]{0,64}$") is None


def test_a_loop_over_a_part_that_can_match_nothing_is_kept() -> None:
    """libllama's stack dedupe folds the iterations of a loop: (a?)* samples in 10 ms."""
    for pattern in ("^(a?)*$", "^(a?)+$", "^(a*)*$"):
        assert pattern_stall(pattern) is None


def test_the_same_pattern_is_refused_in_a_tool_whatever_tool_choice_says() -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": string_schema("^(a?){1000}$")}}
    for choice in ("auto", "required"):
        with pytest.raises(InvalidRequest) as refused:
            check_tools([tool], choice, LimitsConfig())
        assert refused.value.param == "tools"
        assert "1000 parse stacks" in refused.value.message


def test_a_pattern_under_a_ref_is_refused_where_it_is_used() -> None:
    schema = {
        "type": "object",
        "properties": {"code": {"$ref": "#/$defs/code"}},
        "$defs": {"code": {"type": "string", "pattern": "^(a|b?){1000}$"}},
    }
    with pytest.raises(InvalidRequest, match="2000 parse stacks"):
        check_schema(schema, LimitsConfig(), "format")


def test_what_the_converter_refuses_is_left_to_the_converter() -> None:
    assert pattern_stall("^(?:ab)+$") is None
    with pytest.raises(InvalidRequest, match="converter refuses"):
        check_schema(string_schema("^(?:ab)+$"), LimitsConfig(), "response_format")
