"""What the request log reads from a call: routes, levels, redaction, input text, and the usage,
telemetry, error and output of JSON and SSE responses."""

from __future__ import annotations

import json

import pytest

from hypnos_site.errors import InvalidRequest
from logs.capture import (
    MAX_TEXT_CHARS,
    Redactor,
    ResponseReading,
    entry_level,
    inference_route,
    input_text,
    is_kept,
)
from logs.store import LogQuery

USAGE = {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38, "prompt_tokens_details": {"cached_tokens": 4}}
TELEMETRY = {"previous_tier": "tier2_pinned_ram", "inference_latency_ms": 120.0, "tier_switch_latency_ms": 33.0,
             "evicted_models": [], "engine": {"ttft_ms": 20.0, "decode_tokens_per_s": 58.2}}


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events)


def chunk(content: str | None = None, **extra: object) -> dict:
    delta = {"content": content} if content is not None else {}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], **extra}


@pytest.mark.parametrize(
    ("path", "route"),
    [("/v1/chat/completions", "/v1/chat/completions"), ("/api/v1/embeddings", "/v1/embeddings"),
     ("/v1/logs", None), ("/v1/models", None), ("/metrics", None), ("/v1/chat/completions/x", None)],
)
def test_only_the_token_counting_routes_are_inference_calls(path, route):
    assert inference_route(path) == route


def test_an_entry_level_follows_the_status_and_the_threshold_keeps_it_or_not():
    assert [entry_level(200, None), entry_level(200, "mid-stream failure"), entry_level(429, "x"),
            entry_level(503, "x"), entry_level(200, "gone", cancelled=True)] == ["info", "error", "warn", "error", "warn"]
    assert [is_kept("warn", t) for t in ("off", "error", "warn", "info", "debug", "trace")] == [
        False, False, True, True, True, True]
    assert not is_kept("error", "off") and is_kept("error", "error")


def test_redaction_keeps_blanks_or_masks():
    text = "my key is sk-abc123 and my mail a@b.c"
    assert Redactor(None)(text) == text
    assert Redactor("blank")(text) == ""
    assert Redactor(r"sk-[a-z0-9]+|\S+@\S+")(text) == "my key is [redacted] and my mail [redacted]"


def test_the_input_is_the_messages_prompt_or_input_text():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}]}
    assert input_text(chat) == "system: Be brief.\nuser: Hi"
    assert input_text({"prompt": ["a", "b"]}) == "a\nb"
    assert input_text({"input": "embed me", "instructions": "x"}) == "instructions: x\nembed me"
    assert input_text({"input": [1, 2, 3]}) is None and input_text("nope") is None


def test_a_json_answer_gives_usage_telemetry_and_output():
    reading = ResponseReading()
    reading.read_json(json.dumps({"choices": [{"message": {"role": "assistant", "content": "Paris."}}],
                                  "usage": USAGE, "hypnos_telemetry": TELEMETRY}).encode())
    assert reading.tokens() == (31, 7, 4)
    assert reading.charged_tokens() == 38
    assert reading.output.text() == "Paris." and reading.error is None
    assert reading.tokens_per_s() == 58.2


def test_an_sse_stream_cut_anywhere_is_read_whole():
    body = sse(chunk("", role="assistant"), chunk("The"), chunk(" capital"),
               chunk(usage=USAGE, hypnos_telemetry=TELEMETRY), "[DONE]")
    reading = ResponseReading()
    for i in range(0, len(body), 7):
        reading.feed_sse(body[i:i + 7])
    assert reading.output.text() == "The capital" and reading.deltas == 2
    assert reading.usage == USAGE and reading.telemetry == TELEMETRY
    assert reading.payload.text() == body.decode()


def test_an_error_chunk_and_an_error_body_are_read_as_errors():
    reading = ResponseReading()
    reading.feed_sse(sse(chunk("Hel"), chunk(error={"message": "decode failed", "type": "server_error"}), "[DONE]"))
    assert (reading.error, reading.error_type) == ("decode failed", "server_error")
    refused = ResponseReading()
    refused.read_json(b'{"error": {"message": "busy", "type": "model_busy", "param": null, "code": "model_busy"}}')
    assert refused.error_type == "model_busy" and refused.tokens() == (None, None, None)


def test_a_stream_without_usage_is_charged_its_deltas():
    reading = ResponseReading()
    reading.feed_sse(sse(chunk("a"), chunk("b"), chunk("c")))
    assert reading.charged_tokens() == 3


def test_the_responses_api_shapes_are_read_too():
    reading = ResponseReading()
    reading.feed_sse(b"event: response.output_text.delta\n" + sse({"type": "response.output_text.delta", "delta": "Hi"}))
    reading.feed_sse(sse({"type": "response.completed",
                          "response": {"usage": {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}}}))
    assert reading.output.text() == "Hi" and reading.tokens() == (9, 2, None) and reading.charged_tokens() == 11


def test_captured_text_stops_at_the_cap_and_says_so():
    reading = ResponseReading()
    reading.feed_sse(sse(*[chunk("x" * 1000) for _ in range(MAX_TEXT_CHARS // 1000 + 2)]))
    assert len(reading.output.text()) == MAX_TEXT_CHARS and reading.output.truncated


def test_the_log_filters_are_checked():
    query = LogQuery.from_params({"status": "4xx", "route": "/api/v1/chat/completions", "limit": "5", "key": "a"})
    assert (query.status, query.route, query.limit, query.key) == ("4xx", "/v1/chat/completions", 5, "a")
    for params, param in [({"status": "bad"}, "status"), ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit")]:
        with pytest.raises(InvalidRequest) as refused:
            LogQuery.from_params(params)
        assert refused.value.param == param
