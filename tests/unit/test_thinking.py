"""Thinking (spec §7.1, compat.md): the request fields and the <think> block router."""

from __future__ import annotations

import pytest

from inference.engines.thinking import ThinkBlock
from inference.web.common.protocol import parse_body
from inference.web.openai.protocol import ChatCompletionRequest, ChatMessage

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, (False, None)),
        ({"think": True}, (True, None)),
        ({"reasoning_effort": "none", "think": True}, (False, None)),
        ({"reasoning_effort": "minimal"}, (True, 512)),
        ({"reasoning_effort": "low"}, (True, 512)),
        ({"reasoning_effort": "medium"}, (True, 2048)),
        ({"reasoning_effort": "high", "think": False}, (True, 6144)),
        ({"enable_thinking": True}, (True, None)),
        ({"enable_thinking": False}, (False, None)),
        ({"thinking": True}, (True, None)),
        ({"enable_thinking": True, "reasoning_effort": "none"}, (False, None)),
        ({"thinking": False, "reasoning_effort": "medium"}, (True, 2048)),
    ],
)
def test_it_reads_the_thinking_fields_and_their_aliases(fields, expected):
    assert parse_body(ChatCompletionRequest, BASE | fields).thinking_request() == expected


def feed_all(block: ThinkBlock, pieces: list[str]) -> tuple[str, str, list[int]]:
    """Thoughts, answer, and the indices of the pieces after which a close was asked for."""
    thoughts, answer, closes = [], [], []
    for i, piece in enumerate(pieces):
        routed = block.feed(piece)
        thoughts.append(routed.reasoning)
        answer.append(routed.content)
        if routed.close:
            closes.append(i)
            block.forced_close()
    tail = block.flush()
    return "".join(thoughts) + tail.reasoning, "".join(answer) + tail.content, closes


def test_it_splits_thoughts_from_the_answer_across_token_boundaries():
    thoughts, answer, closes = feed_all(ThinkBlock(True, None), ["Let me ", "see.</", "thi", "nk>\n\n", "Paris", "."])
    assert (thoughts, answer, closes) == ("Let me see.", "Paris.", [])


def test_it_asks_for_a_close_when_the_budget_is_spent():
    block = ThinkBlock(True, 3)
    thoughts, answer, closes = feed_all(block, ["a", "b", "c", "d"])
    assert closes == [2]
    assert thoughts == "abc" and answer == "d"
    assert block.thought_tokens == 3


def test_with_thinking_off_a_block_the_model_opens_is_closed_at_once():
    thoughts, answer, closes = feed_all(ThinkBlock(False, None), ["\n<th", "ink>", "hmm", "Paris"])
    assert closes == [1]
    assert thoughts == "" and answer == "hmmParis"


def test_with_thinking_off_text_that_only_looks_like_a_tag_is_the_answer():
    thoughts, answer, closes = feed_all(ThinkBlock(False, None), ["<th", "ree> cats"])
    assert (thoughts, answer, closes) == ("", "<three> cats", [])


def test_a_think_tag_inside_the_answer_is_plain_text():
    _, answer, closes = feed_all(ThinkBlock(False, None), ["Use ", "<think> tags"])
    assert answer == "Use <think> tags" and closes == []


def test_an_unclosed_block_stays_thoughts():
    thoughts, answer, _ = feed_all(ThinkBlock(True, None), ["still thinking </thi"])
    assert thoughts == "still thinking </thi" and answer == ""


def test_image_parts_become_markers_in_order_and_typed_markers_are_removed():
    message = ChatMessage.model_validate(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare <__media__>"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " with "},
                {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
            ],
        }
    )
    assert message.text_with_images() == "Compare <__media__> with <__media__>"
    assert message.image_urls() == ["data:image/png;base64,AAAA", "https://example.com/b.png"]
