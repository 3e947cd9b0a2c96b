from __future__ import annotations

import pytest

from hypnos_site.errors import InvalidRequest
from inference.web.common.protocol import parse_body
from inference.web.openai.protocol import ChatCompletionRequest
from inference.web.openai.protocol_media import EmbeddingRequest

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


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("hi", ["hi"]),
        (["hi", "there"], ["hi", "there"]),
        ([101, 7592, 102], [[101, 7592, 102]]),
        ([[101, 7592, 102], [101, 102]], [[101, 7592, 102], [101, 102]]),
    ],
)
def test_an_embedding_input_of_each_openai_shape_becomes_a_list_of_texts_or_of_token_arrays(given, inputs):
    assert parse_body(EmbeddingRequest, {"model": "m", "input": given}).inputs() == inputs


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ([], "input must not be empty"),
        ([""], "input[0] is an empty string"),
        ([[]], "input[0] is an empty array of token ids"),
        ([[101, 102], []], "input[1] is an empty array of token ids"),
        ([101, -1], "negative token id -1"),
        (["hi", 101], "not an array mixing them"),
        ([101, "hi"], "not an array mixing them"),
        ([[101, 102], "hi"], "not an array mixing them"),
        ([[101, "hi"]], "input[0] must be an array of token ids"),
        ([[101, True]], "input[0] must be an array of token ids"),
        ([True], "not an array mixing them"),
        ([101.0], "not an array mixing them"),
        ([[[101]]], "input[0] must be an array of token ids"),
        (101, "input must be a string, an array of strings"),
        ({"ids": [101]}, "input must be a string, an array of strings"),
    ],
)
def test_an_embedding_input_of_no_openai_shape_is_a_400_naming_input(given, message):
    with pytest.raises(InvalidRequest) as caught:
        parse_body(EmbeddingRequest, {"model": "m", "input": given}).inputs()
    assert caught.value.param == "input" and message in str(caught.value)
