from __future__ import annotations

import pytest

from hypnos_site.errors import InvalidRequest
from inference.protocol import ChatCompletionRequest, parse_body

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_unknown_fields_are_ignored():
    body = parse_body(ChatCompletionRequest, BASE | {"n": 1, "user": "u", "logit_bias": {}})
    assert body.model == "m"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field(extra, param):
    with pytest.raises(InvalidRequest) as caught:
        parse_body(ChatCompletionRequest, BASE | extra)
    assert caught.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_body(ChatCompletionRequest, [1, 2])


def test_content_parts_join_their_text():
    body = parse_body(
        ChatCompletionRequest,
        BASE
        | {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    )
    assert body.messages[0].text() == "ab"


def test_more_than_four_stops_is_a_400():
    body = parse_body(ChatCompletionRequest, BASE | {"stop": ["a", "b", "c", "d", "e"]})
    with pytest.raises(InvalidRequest):
        body.stop_list()
