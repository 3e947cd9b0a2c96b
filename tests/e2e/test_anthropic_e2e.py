"""The official `anthropic` SDK, unchanged, against a live server (issue 17): `messages.create`,
`messages.stream` and `messages.count_tokens` on both deployments, tools on Qwen2.5-Coder-1.5B,
and the SDK's own error classes from Anthropic's error envelope."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.e2e.conftest import KEYED_PLAIN, Server

pytestmark = pytest.mark.e2e
MODEL, TOOL_MODEL = "smollm2-135m", "qwen2.5-coder-0.5b"
SYSTEM = "You are a helpful assistant."
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]
# The SDK's Messages.create takes no sampling fields any more; the API still reads them, as this
# server does, so they travel as extra_body (greedy decoding: answers the tests can compare).
GREEDY = {"temperature": 0}


def sdk(server: Server, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=300)


def test_messages_create_gets_the_models_real_answer(server):
    message = sdk(server).messages.create(model=MODEL, max_tokens=64, system=SYSTEM, messages=PARIS, extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and "Paris" in block.text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 20
    assert message.usage.output_tokens > 3
    assert message.model_extra["hypnos_telemetry"]["placement"]["primary_tier"] == "tier1_gpu_vram"


def test_messages_stream_gives_the_same_answer_event_by_event(server):
    client = sdk(server)
    whole = client.messages.create(model=MODEL, max_tokens=64, system=SYSTEM, messages=PARIS, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=64, system=SYSTEM, messages=PARIS, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(model=MODEL, max_tokens=64, system=SYSTEM, messages=PARIS, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


def test_count_tokens_is_the_prompt_the_answer_reports(server):
    client = sdk(server)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=PARIS)
    message = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=PARIS)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_stop_sequences_and_max_tokens_end_the_answer_as_anthropic_says(server):
    client = sdk(server)
    stopped = client.messages.create(
        model=MODEL, max_tokens=64, system=SYSTEM, messages=PARIS, extra_body=GREEDY, stop_sequences=[" Paris"]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " Paris"
    assert "Paris" not in stopped.content[0].text
    cut = client.messages.create(model=MODEL, max_tokens=3, system=SYSTEM, messages=PARIS, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_output_config_format_answers_json_of_the_schema(server):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    message = sdk(server).messages.create(
        model=MODEL,
        max_tokens=48,
        system=SYSTEM,
        messages=PARIS,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert set(json.loads(message.content[0].text)) == {"capital"}


def test_a_tool_use_and_its_tool_result_follow_up(embedded):
    client = sdk(embedded)
    first = client.messages.create(
        model=TOOL_MODEL, max_tokens=256, messages=ASK_WEATHER, tools=[WEATHER], extra_body=GREEDY
    )
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    history = ASK_WEATHER + [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temp_c": 18, "sky": "sunny"}'}],
        },
    ]
    answer = client.messages.create(
        model=TOOL_MODEL, max_tokens=256, messages=history, tools=[WEATHER], extra_body=GREEDY
    )
    assert answer.stop_reason == "end_turn" and "18" in answer.content[0].text


def test_a_streamed_tool_use_accumulates_its_input(embedded):
    with sdk(embedded).messages.stream(
        model=TOOL_MODEL,
        max_tokens=256,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_refusals_raise_the_sdks_own_errors_streamed_or_not(server):
    client = sdk(server)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=PARIS)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with (
        pytest.raises(anthropic.NotFoundError),
        client.messages.stream(model="no-such-model", max_tokens=8, messages=PARIS),
    ):
        pass
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=PARIS, extra_body={"temperature": 1.5})
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]


def test_the_sdks_x_api_key_authenticates_and_a_wrong_one_is_its_authentication_error(keyed):
    """On the suite's shared server with keys (`keyed`): a plain key passes as x-api-key."""
    message = sdk(keyed, KEYED_PLAIN).messages.create(model=MODEL, max_tokens=2, messages=PARIS)
    assert message.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as caught:
        sdk(keyed, "sk-wrong").messages.create(model=MODEL, max_tokens=2, messages=PARIS)
    assert caught.value.body["error"]["type"] == "authentication_error"
