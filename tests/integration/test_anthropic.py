"""Anthropic's Messages API (issue 17) through the views, the serving code and the in-process
worker onto real llama.cpp models: SmolLM2-135M for text, thinking (configured with think_tags)
and images (with the tiny random-weight projector of test_vision.py), Qwen2.5-Coder-0.5B for
tools. count_tokens is held to what /v1/messages itself reports for the same request."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import models_registry.quotas as quotas_module
from hypnos_site.config import KeyConfig
from inference.worker import Worker
from memory.gguf import read_gguf
from tests.integration.conftest import post_json, queue_filled, with_limits, with_server
from tests.integration.test_http_contract import FailingAfterOneTokenEngine, with_engine
from tests.integration.test_vision import TOKENS_PER_IMAGE, png_data_url, write_tiny_projector

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, CODER, PIPER = "smollm2-135m", "qwen2.5-coder-0.5b", "piper-joe"
THINKER, SEEING = "smollm2-thinking", "smollm2-seeing"
URL, COUNT = "/v1/messages", "/v1/messages/count_tokens"
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# The answer SmolLM2 gives PARIS at temperature 0 (with SYSTEM).
SYSTEM = "You are a helpful assistant."
PARIS_ANSWER = "The capital of France is Paris."
TOO_LONG = "hello " * 9500  # ~9500 tokens, beyond SmolLM2's trained 8192
STORY = [{"role": "user", "content": "Write a very long story about a dragon, at least 2000 words."}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CURRENCY = {
    "name": "convert_currency",
    "description": "Convert an amount between currencies",
    "input_schema": {
        "type": "object",
        "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string"},
            "to_currency": {"type": "string"},
        },
        "required": ["amount", "from_currency", "to_currency"],
    },
}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


def ask(model: str = SMOL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 48, "temperature": 0, "system": SYSTEM, "messages": PARIS, **extra}


def counted(body: dict[str, Any]) -> dict[str, Any]:
    """The count_tokens body of a messages body: what shapes the prompt, nothing that samples."""
    keys = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
    return {key: value for key, value in body.items() if key in keys}


async def message(api: Any, body: dict[str, Any], path: str = URL, **headers: str) -> dict[str, Any]:
    response = await post_json(api, path, body, **headers)
    assert response.status_code == 200, response.content
    assert response["x-request-id"].startswith("req-")
    return response.json()  # type: ignore[no-any-return]


async def count(api: Any, body: dict[str, Any]) -> int:
    response = await post_json(api, COUNT, counted(body))
    assert response.status_code == 200, response.content
    answer = response.json()
    assert set(answer) == {"input_tokens"}
    return answer["input_tokens"]  # type: ignore[no-any-return]


async def stream(api: Any, body: dict[str, Any], **headers: str) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a streamed answer; each data's type is its event's name."""
    response = await post_json(api, URL, body | {"stream": True}, **headers)
    assert response.status_code == 200, response.content
    assert response["content-type"].startswith("text/event-stream")
    assert response["x-request-id"].startswith("req-") and "x-hypnos-estimated-wait-ms" in response
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and "text" in d["delta"])


def final_delta(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    [delta] = [d for n, d in events if n == "message_delta"]
    return delta


def whole_prompt(usage: dict[str, Any]) -> int:
    """Anthropic counts the prompt tokens the prefix cache held apart from the ones evaluated."""
    return usage["input_tokens"] + usage["cache_read_input_tokens"]  # type: ignore[no-any-return]


def assert_anthropic_error(response: Any, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, getattr(response, "content", b"")[:300])
    assert response["content-type"].startswith("application/json")
    assert response["x-request-id"].startswith("req-")
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body  # type: ignore[no-any-return]


async def refused_both_ways(api: Any, body: dict[str, Any], status: int, kind: str, **headers: str) -> str:
    """The same status and envelope with and without `stream`: every refusal comes before the
    first byte. The message, for the caller to check."""
    messages = []
    for streamed in (False, True):
        response = await post_json(api, URL, body | {"stream": streamed}, **headers)
        # Pillow names the buffer it could not read by its address.
        messages.append(
            re.sub(r" at 0x[0-9a-f]+", "", assert_anthropic_error(response, status, kind)["error"]["message"])
        )
    assert messages[0] == messages[1]
    return messages[0]


# -- text -------------------------------------------------------------------------------------


async def test_it_answers_with_the_models_real_answer(api):
    response = await post_json(api, URL, ask())
    assert response.status_code == 200 and float(response["x-hypnos-estimated-wait-ms"]) >= 0
    body = response.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == SMOL
    assert body["content"] == [{"type": "text", "text": PARIS_ANSWER}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    usage = body["usage"]
    assert whole_prompt(usage) > 20 and usage["output_tokens"] == 7
    assert usage["cache_creation_input_tokens"] == 0
    assert body["hypnos_telemetry"]["placement"]["primary_tier"] == "tier1_gpu_vram"


async def test_system_blocks_and_text_blocks_make_the_same_prompt_as_strings(api):
    blocks = ask(
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": PARIS[0]["content"]}]}],
    )
    assert await count(api, blocks) == await count(api, ask())
    assert (await message(api, blocks))["content"] == [{"type": "text", "text": PARIS_ANSWER}]


async def test_the_stream_is_anthropics_event_sequence_with_the_same_answer(api):
    whole = await message(api, ask())
    events = await stream(api, ask())
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole_prompt(whole["usage"])
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    assert streamed_text(events) == PARIS_ANSWER
    delta = final_delta(events)
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert whole_prompt(delta["usage"]) == whole_prompt(whole["usage"])
    assert delta["hypnos_telemetry"]["placement"]["primary_tier"] == "tier1_gpu_vram"


async def test_a_stop_sequence_cuts_the_answer_before_it_and_is_named(api):
    body = await message(api, ask(stop_sequences=["Berlin", " Paris"]))
    assert body["content"] == [{"type": "text", "text": "The capital of France is"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", " Paris")
    events = await stream(api, ask(stop_sequences=["Berlin", " Paris"]))
    assert streamed_text(events) == "The capital of France is"
    assert final_delta(events)["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " Paris"}


async def test_max_tokens_ends_the_answer_with_stop_reason_max_tokens(api):
    body = await message(api, ask(max_tokens=3))
    assert body["usage"]["output_tokens"] == 3 and body["stop_reason"] == "max_tokens"
    assert body["content"] == [{"type": "text", "text": "The capital of"}]
    delta = final_delta(await stream(api, ask(max_tokens=3)))
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 3


async def test_an_earlier_assistant_turn_is_in_the_prompt(api):
    def history(reply: str) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
            {"role": "user", "content": "What is my name?"},
        ]

    body = await message(api, ask(messages=history("Nice to meet you, Ada.")))
    assert body["content"][0]["text"] and body["stop_reason"] == "end_turn"
    tokens = await count(api, ask(messages=history("Nice to meet you, Ada.")))
    assert whole_prompt(body["usage"]) == tokens
    assert tokens > await count(api, ask(messages=history("Hi.")))


async def test_the_lemonade_prefix_serves_the_same_route(api):
    body = await message(api, ask(max_tokens=3), path="/api/v1/messages")
    assert body["content"] == [{"type": "text", "text": "The capital of"}]


async def test_output_config_format_makes_the_answer_json_of_the_schema(api):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    body = ask(output_config={"format": {"type": "json_schema", "schema": schema}})
    answer = await message(api, body)
    assert answer["stop_reason"] == "end_turn"
    assert set(json.loads(answer["content"][0]["text"])) == {"capital"}
    assert whole_prompt(answer["usage"]) == await count(api, body)
    too_big = {"type": "json_schema", "schema": {"type": "string", "minLength": 5000}}
    words = await refused_both_ways(api, ask(output_config={"format": too_big}), 400, "invalid_request_error")
    assert "max_grammar_repetition" in words


# -- count_tokens -----------------------------------------------------------------------------


async def test_count_tokens_is_the_prompt_the_messages_route_evaluates(api):
    for body in (ask(), ask(system=None), ask(messages=PARIS * 3)):
        tokens = await count(api, body)
        assert whole_prompt((await message(api, body | {"max_tokens": 1}))["usage"]) == tokens
    assert await count(api, ask(messages=PARIS * 3)) > await count(api, ask())


async def test_count_tokens_counts_a_prompt_beyond_the_context_without_running_it(api, worker):
    tokens = await count(api, ask(messages=[{"role": "user", "content": TOO_LONG}]))
    assert tokens > worker.models[SMOL].engine.trained_context_len
    assert worker.models[SMOL].admitted == 0


# -- refusals ---------------------------------------------------------------------------------


async def test_an_unknown_model_is_the_same_404_streamed_or_not(api):
    message_text = await refused_both_ways(api, ask(model="no-such-model"), 404, "not_found_error")
    assert "no-such-model" in message_text
    assert_anthropic_error(await post_json(api, COUNT, counted(ask(model="no-such-model"))), 404, "not_found_error")


async def test_a_model_that_does_not_chat_is_the_same_400_streamed_or_not(api):
    assert "text_to_speech" in await refused_both_ways(api, ask(model=PIPER), 400, "invalid_request_error")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 48}}, "budget_tokens"),
        ({"messages": PARIS + [{"role": "assistant", "content": "The capital"}]}, "prefill"),
    ],
    ids=[
        "no-max-tokens",
        "temperature",
        "no-messages",
        "system-role",
        "document-block",
        "server-tool",
        "any-without-tools",
        "unknown-tool-choice",
        "budget-not-below-max-tokens",
        "prefill",
    ],
)
async def test_a_bad_parameter_is_the_same_400_streamed_or_not(api, change, words):
    body = {key: value for key, value in (ask() | change).items() if value is not None}
    assert words in await refused_both_ways(api, body, 400, "invalid_request_error")


async def test_a_body_that_is_not_json_is_a_400_in_anthropics_envelope(api):
    response = await api.post(URL, data="{not json", content_type="application/json")
    assert "parse" in assert_anthropic_error(response, 400, "invalid_request_error")["error"]["message"]


async def test_a_wrong_method_is_a_405_in_anthropics_envelope(api):
    assert_anthropic_error(await api.get(URL), 405, "api_error")


async def test_a_prompt_beyond_the_context_is_the_same_400_streamed_or_not(api):
    body = ask(messages=[{"role": "user", "content": TOO_LONG}])
    assert "tokens" in await refused_both_ways(api, body, 400, "invalid_request_error")


async def test_tools_on_a_model_without_a_tool_format_are_the_same_400_streamed_or_not(api):
    assert "tool" in await refused_both_ways(api, ask(tools=[WEATHER]), 400, "invalid_request_error")


async def test_an_image_for_a_model_without_vision_is_the_same_400_streamed_or_not(api):
    content = [image_block(png_data_url()), {"type": "text", "text": "What is this?"}]
    body = ask(messages=[{"role": "user", "content": content}])
    assert "vision" in await refused_both_ways(api, body, 400, "invalid_request_error")


async def test_a_full_queue_is_the_same_429_streamed_or_not(api, settings, worker):
    # As if limits.max_queue_per_model requests were queued or running on the model.
    with queue_filled(worker, SMOL, settings.HYPNOS.limits.max_queue_per_model):
        assert "queued" in await refused_both_ways(api, ask(), 429, "rate_limit_error")


async def test_a_model_beyond_the_memory_budget_is_the_same_507_streamed_or_not(api, settings, serve):
    # 1 MB of simulated VRAM and no partial placements: SmolLM2 does not fit.
    smol = next(m for m in settings.HYPNOS.models if m.id == SMOL).model_copy(update={"initial_tier": "tier3_nvme_ssd"})
    hardware = settings.HYPNOS.hardware.model_copy(
        update={"simulated_vram_bytes": 1_000_000, "min_gpu_layer_ratio": 1.0}
    )
    worker = serve(settings.HYPNOS.model_copy(update={"models": [smol], "hardware": hardware}))
    await refused_both_ways(api, ask(), 507, "overloaded_error")
    assert worker.models[SMOL].admitted == 0


async def test_a_failure_mid_stream_is_one_error_event_after_what_was_sent(api, settings, use_worker):
    worker = Worker(settings.HYPNOS)
    use_worker(with_engine(worker, FailingAfterOneTokenEngine(worker.models[SMOL].config, None, 1)))
    response = await post_json(api, URL, ask(stream=True))
    assert response.status_code == 200
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    blocks = raw.strip().split("\n\n")
    assert [block.split("\n")[0] for block in blocks] == [
        "event: message_start",
        "event: ping",
        "event: content_block_start",
        "event: content_block_delta",
        "event: error",
    ]
    assert '"text": "Hel"' in blocks[3]
    error = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "decode failed" in error["error"]["message"]
    # Not streamed, the same failure is a 500 in the envelope.
    assert (
        "decode failed"
        in assert_anthropic_error(await post_json(api, URL, ask()), 500, "api_error")["error"]["message"]
    )
    assert worker.models[SMOL].admitted == 0


# -- keys -------------------------------------------------------------------------------------

KEY, LIMITED, NARROW = "sk-anthropic-admin", "sk-anthropic-rpm", "sk-anthropic-narrow"


@pytest.fixture
def keys(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quotas_module, "_memory_quotas", quotas_module.MemoryQuotas())
    with_server(
        settings,
        api_keys=[KEY],
        keys=[
            KeyConfig(key=LIMITED, label="rpm", requests_per_minute=1),
            KeyConfig(key=NARROW, label="narrow", models=[CODER]),
        ],
    )


async def test_a_missing_or_wrong_key_is_a_401_in_anthropics_envelope(api, keys):
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"authorization": "Bearer sk-wrong"}):
        response = await post_json(api, URL, ask(max_tokens=2), **headers)
        assert "API key" in assert_anthropic_error(response, 401, "authentication_error")["error"]["message"]
        assert response["WWW-Authenticate"].startswith("Bearer")
    await refused_both_ways(api, ask(max_tokens=2), 401, "authentication_error")
    assert_anthropic_error(await post_json(api, COUNT, counted(ask())), 401, "authentication_error")


async def test_x_api_key_and_bearer_both_authenticate(api, keys):
    assert (await message(api, ask(max_tokens=2), **{"x-api-key": KEY}))["usage"]["output_tokens"] == 2
    assert (await message(api, ask(max_tokens=2), authorization=f"Bearer {KEY}"))["usage"]["output_tokens"] == 2


async def test_a_keys_own_limits_refuse_in_anthropics_envelope(api, keys):
    await message(api, ask(max_tokens=2), **{"x-api-key": LIMITED})
    response = await post_json(api, URL, ask(max_tokens=2), **{"x-api-key": LIMITED})
    assert "requests" in assert_anthropic_error(response, 429, "rate_limit_error")["error"]["message"]
    assert int(response["Retry-After"]) >= 1
    # A key that may use another model only, for a generation or a count.
    for path, body in ((URL, ask(max_tokens=2)), (COUNT, counted(ask()))):
        response = await post_json(api, path, body, **{"x-api-key": NARROW})
        assert CODER in assert_anthropic_error(response, 403, "permission_error")["error"]["message"]


# -- thinking ---------------------------------------------------------------------------------


@pytest.fixture
def thinker(settings, serve) -> Worker:
    """SmolLM2 twice: as configured (no thinking format) and as `smollm2-thinking` (think_tags)."""
    smol = next(m for m in settings.HYPNOS.models if m.id == SMOL)
    thinker = smol.model_copy(
        update={
            "id": THINKER,
            "aliases": [],
            "thinking": "think_tags",
            "initial_tier": "tier3_nvme_ssd",
            "speech_to_text_model": None,
        }
    )
    return serve(settings.HYPNOS.model_copy(update={"models": [smol, thinker]}))


THINK = {"thinking": {"type": "enabled", "budget_tokens": 16}, "max_tokens": 48, "messages": STORY}


async def test_thinking_comes_first_as_a_thinking_block_then_the_answer(api, thinker):
    body = await message(api, ask(THINKER, **THINK))
    thinking, text = body["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] and thinking["signature"] == ""
    assert text["type"] == "text" and text["text"] and "think>" not in text["text"] + thinking["thinking"]
    assert body["usage"]["output_tokens"] <= 48


async def test_streamed_thoughts_are_block_zero_and_the_answer_block_one(api, thinker):
    events = await stream(api, ask(THINKER, **THINK))
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events if n == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    kinds = {(d["index"], d["delta"]["type"]) for n, d in events if n == "content_block_delta"}
    assert kinds == {(0, "thinking_delta"), (1, "text_delta")}
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]


async def test_a_model_without_a_thinking_format_ignores_thinking(api, thinker):
    body = await message(api, ask(SMOL, **THINK))
    assert [block["type"] for block in body["content"]] == ["text"]


# -- tools ------------------------------------------------------------------------------------


@pytest.fixture
def coder(settings, serve_shared) -> Worker:
    """SmolLM2 and Qwen2.5-Coder-0.5B, whose template has a tool-call format: the tool tests
    share it, so the 0.5B is loaded once for them."""
    models = [m for m in settings.HYPNOS.models if m.id in (SMOL, CODER)]
    return serve_shared(settings.HYPNOS.model_copy(update={"models": models}))


def tool_ask(**extra: Any) -> dict[str, Any]:
    return {"model": CODER, "max_tokens": 64, "temperature": 0, "messages": ASK_WEATHER, "tools": [WEATHER], **extra}


async def test_a_tool_use_and_its_tool_result_follow_up(api, coder):
    first = await message(api, tool_ask(tools=[WEATHER, CURRENCY]))
    assert first["stop_reason"] == "tool_use"
    [call] = [block for block in first["content"] if block["type"] == "tool_use"]
    assert call["id"].startswith("toolu_") and call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    history = ASK_WEATHER + [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call["id"], "content": '{"temp_c": 18, "sky": "sunny"}'}
            ],
        },
    ]
    answer = await message(api, tool_ask(tools=[WEATHER, CURRENCY], messages=history))
    assert answer["stop_reason"] == "end_turn"
    [text] = answer["content"]
    assert "18" in text["text"]
    assert whole_prompt(answer["usage"]) == await count(api, tool_ask(tools=[WEATHER, CURRENCY], messages=history))


async def test_tool_choice_tool_forces_that_call(api, coder):
    body = tool_ask(
        messages=[{"role": "user", "content": "Convert 250 US dollars to euros."}],
        tools=[WEATHER, CURRENCY],
        tool_choice={"type": "tool", "name": "convert_currency"},
    )
    answer = await message(api, body)
    [call] = answer["content"]
    assert call["name"] == "convert_currency" and answer["stop_reason"] == "tool_use"
    assert call["input"] == {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}
    assert whole_prompt(answer["usage"]) == await count(api, body)


async def test_tool_choice_any_forces_a_call_and_none_hides_the_tools(api, coder):
    forced = await message(api, tool_ask(tool_choice={"type": "any"}))
    assert [b["type"] for b in forced["content"]] == ["tool_use"] and forced["content"][0]["name"] == "get_weather"
    hidden = await message(api, tool_ask(tool_choice={"type": "none"}, max_tokens=24))
    assert [b["type"] for b in hidden["content"]] == ["text"] and hidden["stop_reason"] != "tool_use"


async def test_a_streamed_tool_use_is_a_tool_use_block_with_its_input_as_json(api, coder):
    events = await stream(api, tool_ask())
    [start] = [d for n, d in events if n == "content_block_start"]
    block = start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    [delta] = [d for n, d in events if n == "content_block_delta"]
    assert delta["index"] == start["index"] and delta["delta"]["type"] == "input_json_delta"
    assert json.loads(delta["delta"]["partial_json"]) == {"city": "Paris"}
    assert final_delta(events)["delta"]["stop_reason"] == "tool_use"
    assert [n for n, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]


# -- images -----------------------------------------------------------------------------------


def image_block(data_url: str) -> dict[str, Any]:
    media_type, _, data = data_url.removeprefix("data:").partition(";base64,")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    from django.conf import settings

    weights = settings.HYPNOS.weights_file(next(m for m in settings.HYPNOS.models if m.id == SMOL))
    path = tmp_path_factory.mktemp("anthropic-vision") / "tiny-mmproj.gguf"
    write_tiny_projector(path, int(read_gguf(weights).metadata["llama.embedding_length"]))
    return path


@pytest.fixture
def seeing(settings, serve, projector) -> Worker:
    """SmolLM2 as configured and as `smollm2-seeing` with the tiny projector."""
    smol = next(m for m in settings.HYPNOS.models if m.id == SMOL)
    update = {"id": SEEING, "aliases": [], "aux_path": str(projector), "initial_tier": "tier3_nvme_ssd"}
    config = settings.HYPNOS.model_copy(update={"models": [smol, smol.model_copy(update=update)]})
    settings.HYPNOS = config
    return serve(config)


def look(*blocks: dict[str, Any]) -> dict[str, Any]:
    content = [*blocks, {"type": "text", "text": "Describe the picture."}]
    return ask(SEEING, max_tokens=8, messages=[{"role": "user", "content": content}])


@pytest.fixture
def picture_server() -> Iterator[str]:
    """A PNG served over HTTP on 127.0.0.1 (a private address: only allow_private_urls lets it in)."""
    png = base64.b64decode(png_data_url((0, 90, 200)).partition(",")[2])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/picture.png"
    finally:
        server.shutdown()
        server.server_close()


async def test_an_image_block_reaches_the_model_and_is_counted(api, seeing):
    text_only = await count(api, look())
    body = look(image_block(png_data_url()))
    tokens = await count(api, body)
    assert tokens == text_only + TOKENS_PER_IMAGE
    answer = await message(api, body)
    assert whole_prompt(answer["usage"]) == tokens and answer["content"][0]["text"]
    two = look(image_block(png_data_url()), image_block(png_data_url((0, 0, 255))))
    assert await count(api, two) == tokens + TOKENS_PER_IMAGE
    assert streamed_text(await stream(api, body))


async def test_an_image_url_source_is_fetched_under_the_image_url_rules(api, seeing, settings, picture_server):
    body = look({"type": "image", "source": {"type": "url", "url": picture_server}})
    assert "non-public" in await refused_both_ways(api, body, 400, "invalid_request_error")
    with_limits(settings, allow_private_urls=True)
    answer = await message(api, body)
    assert whole_prompt(answer["usage"]) == await count(api, body) == await count(api, look()) + TOKENS_PER_IMAGE


async def test_a_bad_image_is_the_same_400_streamed_or_not(api, seeing):
    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
    assert "image" in await refused_both_ways(api, look(broken), 400, "invalid_request_error")
