"""Tools, JSON schemas, logprobs, /v1/completions, /v1/responses and Lemonade's routes with real
models (Qwen2.5-Coder-0.5B for tools and JSON; the 1.5B where the model must judge that no tool
is needed, which the 0.5B gets wrong; SmolLM2 for the rest) through the official SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
TOOL_MODEL, JUDGING_MODEL, SMALL = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CURRENCY = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount between currencies",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from_currency": {"type": "string"},
                "to_currency": {"type": "string"},
            },
            "required": ["amount", "from_currency", "to_currency"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(embedded: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedded.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_tool_call_and_its_follow_up_answer(client):
    first = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK_WEATHER, tools=[WEATHER, CURRENCY], temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK_WEATHER + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "condition": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=TOOL_MODEL, messages=history, tools=[WEATHER, CURRENCY], temperature=0
    )
    assert answer.choices[0].finish_reason == "stop"
    text = answer.choices[0].message.content
    assert "18" in text and "sunny" in text.lower()


def test_a_question_that_needs_no_tool_gets_an_answer(client):
    completion = client.chat.completions.create(
        model=JUDGING_MODEL,
        tools=[WEATHER, CURRENCY],
        temperature=0,
        max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.tool_calls is None
    assert "Paris" in completion.choices[0].message.content


def test_a_streamed_tool_call_arrives_whole_in_one_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=TOOL_MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, stream=True
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_tool_choice_forces_that_call(client):
    messages = [{"role": "user", "content": "Convert 250 US dollars to euros."}]
    completion = client.chat.completions.create(
        model=TOOL_MODEL,
        messages=messages,
        tools=[WEATHER, CURRENCY],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "convert_currency"}},
    )
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "convert_currency"
    assert json.loads(call.function.arguments) == {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}


def test_tool_choice_none_hides_the_tools(client):
    completion = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].message.content


def test_tools_on_a_model_without_a_tool_format_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SMALL, messages=ASK_WEATHER, tools=[WEATHER])
    assert caught.value.body["param"] == "tools"


def test_a_json_schema_extraction_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {"person": {"type": "string"}, "city": {"type": "string"}, "company": {"type": "string"}},
        "required": ["person", "city", "company"],
        "additionalProperties": False,
    }
    completion = client.chat.completions.create(
        model=TOOL_MODEL,
        temperature=0,
        max_tokens=80,
        messages=[
            {
                "role": "system",
                "content": "Extract entities from the user's text. Reply with a JSON object "
                "with keys person, city, company.",
            },
            {"role": "user", "content": "Extract person, city, company from: Mario Rossi works in Milan for Ferrari."},
        ],
        response_format={"type": "json_schema", "json_schema": {"name": "entities", "schema": schema}},
    )
    assert json.loads(completion.choices[0].message.content) == {
        "person": "Mario Rossi",
        "city": "Milan",
        "company": "Ferrari",
    }


def test_json_object_mode_always_parses(client):
    completion = client.chat.completions.create(
        model=SMALL, messages=PARIS_MESSAGES, max_tokens=60, response_format={"type": "json_object"}, temperature=0
    )
    text = completion.choices[0].message.content
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def test_logprobs_tokens_join_to_the_content(client):
    completion = client.chat.completions.create(
        model=SMALL, messages=PARIS_MESSAGES, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = completion.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == completion.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in entries)
    streamed = list(
        client.chat.completions.create(model=SMALL, messages=PARIS_MESSAGES, temperature=0, logprobs=True, stream=True)
    )
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(tokens) == completion.choices[0].message.content


def test_a_stop_sequence_across_tokens_through_the_sdk(client):
    completion = client.chat.completions.create(model=SMALL, messages=PARIS_MESSAGES, temperature=0, stop=["is Par"])
    assert completion.choices[0].message.content == "The capital of France "
    assert completion.choices[0].finish_reason == "stop"


def test_completions_continue_a_prompt(client):
    completion = client.completions.create(
        model=SMALL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.text and completion.usage.completion_tokens == 5 and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == choice.text
    streamed = list(
        client.completions.create(
            model=SMALL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_a_responses_stream_completes_with_the_concatenated_deltas(client):
    events = list(
        client.responses.create(
            model=SMALL,
            input="What is the capital of France? Answer in one sentence.",
            instructions="You are a helpful assistant.",
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in deltas
    assert events[-1].response.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(
        model=SMALL,
        input="What is the capital of France? Answer in one sentence.",
        instructions="You are a helpful assistant.",
        temperature=0,
    )
    assert whole.output_text == deltas and whole.usage.output_tokens > 0


def test_a_responses_tool_call(client):
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": WEATHER["function"]["parameters"],
    }
    response = client.responses.create(
        model=TOOL_MODEL, input="What's the weather in Paris?", tools=[tool], temperature=0
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_lemonade_load_health_stats_unload(embedded):
    base = f"{embedded.base_url}/api/v1"
    assert httpx.post(f"{base}/load", json={"model_name": TOOL_MODEL}, timeout=120).json()["status"] == "success"
    health = httpx.get(f"{base}/health", timeout=30).json()
    assert health["status"] == "ok"
    assert TOOL_MODEL in [m["model_name"] for m in health["all_models_loaded"]]
    httpx.post(
        f"{base}/chat/completions", timeout=120, json={"model": SMALL, "messages": PARIS_MESSAGES, "max_tokens": 3}
    )
    stats = httpx.get(f"{base}/stats", timeout=30).json()
    assert stats["output_tokens"] == 3 and stats["input_tokens"] > 0 and stats["tokens_per_second"] > 0
    assert httpx.post(f"{base}/unload", json={"model_name": TOOL_MODEL}, timeout=60).status_code == 200
    health = httpx.get(f"{base}/health", timeout=30).json()
    assert TOOL_MODEL not in [m["model_name"] for m in health["all_models_loaded"]]
    assert httpx.post(f"{base}/unload", json={"model_name": "nope"}, timeout=30).status_code == 404
