"""What the request log reads from a call: routes, levels, redaction, input text, and the call's
record (usage, telemetry, error, the charge)."""

from __future__ import annotations

import json

import pytest

from hypnos_site.errors import InvalidRequest
from logs.capture import (
    MAX_TEXT_CHARS,
    CapturedText,
    Redactor,
    entry_level,
    inference_route,
    input_text,
    is_kept,
)
from logs.record import CallRecord
from logs.store import LogQuery

USAGE = {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38, "prompt_tokens_details": {"cached_tokens": 4}}
TELEMETRY = {
    "previous_tier": "tier2_pinned_ram",
    "inference_latency_ms": 120.0,
    "tier_switch_latency_ms": 33.0,
    "evicted_models": [],
    "engine": {"ttft_ms": 20.0, "decode_tokens_per_s": 58.2},
}


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events)


def chunk(content: str | None = None, **extra: object) -> dict:
    delta = {"content": content} if content is not None else {}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], **extra}


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/api/v1/embeddings", "/v1/embeddings"),
        ("/v1/logs", None),
        ("/v1/models", None),
        ("/metrics", None),
        ("/v1/chat/completions/x", None),
    ],
)
def test_only_the_token_counting_routes_are_inference_calls(path, route):
    assert inference_route(path) == route


def test_an_entry_level_follows_the_status_and_the_threshold_keeps_it_or_not():
    assert [
        entry_level(200, None),
        entry_level(200, "mid-stream failure"),
        entry_level(429, "x"),
        entry_level(503, "x"),
        entry_level(200, "gone", cancelled=True),
    ] == ["info", "error", "warn", "error", "warn"]
    assert [is_kept("warn", t) for t in ("off", "error", "warn", "info", "debug", "trace")] == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert not is_kept("error", "off") and is_kept("error", "error")


def test_redaction_keeps_blanks_or_masks():
    text = "my key is sk-abc123 and my mail a@b.c"
    assert Redactor(None)(text) == text
    assert Redactor("blank")(text) == ""
    assert Redactor(r"sk-[a-z0-9]+|\S+@\S+")(text) == "my key is [redacted] and my mail [redacted]"


def test_the_input_is_the_messages_prompt_or_input_text():
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        ]
    }
    assert input_text(chat) == "system: Be brief.\nuser: Hi"
    assert input_text({"prompt": ["a", "b"]}) == "a\nb"
    assert input_text({"input": "embed me", "instructions": "x"}) == "instructions: x\nembed me"
    assert input_text({"input": [1, 2, 3]}) is None and input_text("nope") is None


def test_a_record_gives_usage_telemetry_and_the_charge():
    record = CallRecord(model="smollm2-135m", work="chat")
    record.note_usage(31, 7, 4)
    record.note_telemetry(TELEMETRY)
    assert (record.tokens_in, record.tokens_out, record.cached_tokens) == (31, 7, 4)
    assert record.charged_tokens() == 38 and record.tokens_per_s() == 58.2
    assert record.error is None and record.rtf is None


def test_a_record_cut_before_its_usage_is_charged_its_deltas():
    record = CallRecord()
    record.deltas = 3
    assert record.charged_tokens() == 3 and record.tokens_per_s() is None


def test_the_first_error_noted_is_the_calls():
    record = CallRecord()
    record.note_error("decode failed", "server_error")
    record.note_error("the client disconnected", None)
    assert (record.error, record.error_type) == ("decode failed", "server_error")


def test_speech_telemetry_gives_the_real_time_factor_and_first_audio():
    record = CallRecord(work="speech")
    record.note_telemetry({"engine": {"audio_secs": 2.5, "rtf": 0.21, "ttfa_ms": 80.0}})
    assert (record.audio_secs, record.rtf, record.ttfa_ms) == (2.5, 0.21, 80.0)


def test_captured_text_stops_at_the_cap_and_says_so():
    text = CapturedText()
    for _ in range(MAX_TEXT_CHARS // 1000 + 2):
        text.add("x" * 1000)
    assert len(text.text()) == MAX_TEXT_CHARS and text.truncated


def test_the_log_filters_are_checked():
    query = LogQuery.from_params({"status": "4xx", "route": "/api/v1/chat/completions", "limit": "5", "key": "a"})
    assert (query.status, query.route, query.limit, query.key) == ("4xx", "/v1/chat/completions", 5, "a")
    for params, param in [({"status": "bad"}, "status"), ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit")]:
        with pytest.raises(InvalidRequest) as refused:
            LogQuery.from_params(params)
        assert refused.value.param == param
