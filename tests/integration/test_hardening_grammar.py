"""Issue 12, hardening: JSON-schema grammars, the context check and the 500s of the text routes,
on the real SmolLM2 through views -> serving -> worker -> llama.cpp.

Each request below once crashed or stalled the server (figures from llama-cpp-python 0.3.36 on
this machine): `maxLength` 2000 or `maxItems` 5000 segfaulted libllama (it refuses a repetition
above 1000, returns a NULL sampler, and llama-cpp-python adds it to the chain anyway);
`minLength` 10^9 grew the process to 19 GB until the kernel killed it; a prompt beyond the
context ran its prefill before a 500; lone surrogates, an empty completions prompt, an
unanchored pattern and a dangling $ref were 500s. Each is now a 400 in the spec's envelope
before any engine work (streamed or not), and the server answers a normal chat afterwards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from hypnos_site.config import BASE_DIR
from inference.worker import Worker
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, read_sse, wait_until, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, CODER = "smollm2-135m", "qwen2.5-coder-0.5b"
CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"
# SmolLM2-135M was trained for 8192 tokens: this prompt is 9500 of them (57000 characters, within
# the suite's limits.max_prompt_chars of 60000).
TOO_LONG = "hello " * 9500


@pytest.fixture
def smol(settings, serve_shared) -> Worker:
    """A worker serving only SmolLM2 (as configured), with the views routed to it: the module's
    tests share it (a refused schema or a checked answer leaves it as it was)."""
    model = next(m for m in settings.HYPNOS.models if m.id == SMOL)
    return serve_shared(settings.HYPNOS.model_copy(update={"models": [model]}))


@pytest.fixture
def coder(settings, serve_shared) -> Worker:
    """SmolLM2 and Qwen2.5-Coder-0.5B, whose template has a tool-call format (shared too)."""
    models = [m for m in settings.HYPNOS.models if m.id in (SMOL, CODER)]
    return serve_shared(settings.HYPNOS.model_copy(update={"models": models}))


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SMOL, "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 8, **extra}


def weather_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": parameters},
    }


def assert_refused(response: Any, param: str, code: str = "invalid_request_error", words: str = "") -> dict:
    """400 in the envelope, naming `param`, with a request id (never a 200 stream or a 500)."""
    assert response.status_code == 400, (response.status_code, getattr(response, "content", b"")[:300])
    assert response["content-type"].startswith("application/json")
    assert re.fullmatch(r"req-[0-9a-f]{32}", response["x-request-id"])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code, error
    assert words.lower() in error["message"].lower(), error
    return error


async def assert_still_answers(api: Any) -> None:
    response = await post_json(api, CHAT, {"model": SMOL, "messages": PARIS_MESSAGES, "temperature": 0})
    assert response.status_code == 200
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


# The exact requests of the findings, and their neighbours.
CRASHING_SCHEMAS = {
    "string maxLength 5000": ({"type": "string", "maxLength": 5000}, "maxLength 5000"),
    "string maxLength 2000": ({"type": "string", "maxLength": 2000}, "maxLength 2000"),
    "array maxItems 5000": ({"type": "array", "items": {"type": "integer"}, "maxItems": 5000}, "maxItems 5000"),
    "minLength 10^9": ({"type": "string", "minLength": 1_000_000_000}, "minLength 1000000000"),
    "minLength 3x10^7": ({"type": "string", "minLength": 30_000_000}, "minLength 30000000"),
    "minItems 10^7": ({"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}, "minItems 10000000"),
    "pattern {0,5000}": ({"type": "string", "pattern": "^a{0,5000}$"}, "pattern repetition 5000"),
    "nested 40 deep": (
        {"type": "array", "items": json.loads('{"type": "array", "items": ' * 39 + '{"type": "integer"}' + "}" * 39)},
        "max_grammar_depth",
    ),
    "200 properties": (
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}},
        "max_grammar_properties",
    ),
    "unanchored pattern": ({"type": "string", "pattern": "[a-z]+"}, "not anchored"),
    # Python's regex parser recursed past its limit here: a RecursionError, a 500 (issue 35).
    "pattern of 500 nested groups": (
        {"type": "string", "pattern": "^" + "(" * 500 + "a" + ")" * 500 + "$"},
        "nests 500 groups",
    ),
    "dangling $ref": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "names nothing"),
    "remote $ref": ({"$ref": "https://example.com/schema.json"}, "only local references"),
    "unknown type": ({"type": "strnig"}, "not one of"),
    "untyped sub-schema": ({"type": "object", "properties": {"a": {"description": "anything"}}}, "converter refuses"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(CRASHING_SCHEMAS))
async def test_it_refuses_a_schema_that_would_crash_or_stall_llama_cpp(api, smol, case, stream):
    schema, words = CRASHING_SCHEMAS[case]
    started = time.perf_counter()
    response = await post_json(api, CHAT, chat(response_format=schema_format(schema), stream=stream))
    assert_refused(response, "response_format", words=words)
    # Refused up front, nothing built: under 0.35 s idle (the first request of the process, then
    # ~0.02 s); a stalled grammar would take minutes.
    assert time.perf_counter() - started < 5
    assert smol.models[SMOL].admitted == 0  # the web process refused it: the worker never saw it


NESTED = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^" + "(" * 500 + "a" + ")" * 500 + "$"}}}
# Issue 35: passed every grammar limit, then held the model for more than 600 s (libllama keeps a
# parse stack in each copy of a part that can match nothing; at 150 copies one token took > 30 s).
STALLING = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a?){1000}$"}}}
HELLO = [{"role": "user", "content": "Give me JSON."}]


def schema_routes(schema: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every route that takes a schema, each in its own API's shape."""
    return {
        "chat tools auto": (CHAT, chat(tools=[weather_tool(schema)], tool_choice="auto")),
        "chat tools required": (CHAT, chat(tools=[weather_tool(schema)], tool_choice="required")),
        "responses text.format": (
            RESPONSES,
            {
                "model": SMOL,
                "input": "Give me JSON.",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        ),
        "ollama format": ("/api/chat", {"model": SMOL, "messages": HELLO, "format": schema, "stream": False}),
        "anthropic output_config": (
            "/v1/messages",
            {
                "model": SMOL,
                "max_tokens": 8,
                "messages": HELLO,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
        ),
    }


# Issue 35: all six answered 500.
SCHEMA_ROUTES = schema_routes(NESTED)


@pytest.mark.parametrize("case", list(SCHEMA_ROUTES))
async def test_a_pattern_of_500_nested_groups_is_a_400_on_every_route_that_takes_a_schema(api, smol, case):
    path, body = SCHEMA_ROUTES[case]
    response = await post_json(api, path, body)
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert "nests 500 groups" in response.content.decode()
    assert smol.models[SMOL].admitted == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_pattern_whose_grammar_stalls_the_sampler_is_a_400_and_the_model_stays_free(api, smol, stream):
    started = time.perf_counter()
    response = await post_json(api, CHAT, chat(response_format=schema_format(STALLING), stream=stream))
    assert_refused(response, "response_format", words="has the pattern '^(a?){1000}$', whose grammar keeps 1000")
    assert time.perf_counter() - started < 5
    assert smol.models[SMOL].admitted == 0
    await assert_still_answers(api)


@pytest.mark.parametrize("case", list(SCHEMA_ROUTES))
async def test_a_stalling_pattern_is_a_400_on_every_route_that_takes_a_schema(api, smol, case):
    path, body = schema_routes(STALLING)[case]
    response = await post_json(api, path, body)
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert "1000 parse stacks" in response.content.decode()
    assert smol.models[SMOL].admitted == 0


async def test_the_server_still_answers_after_the_crashing_schemas(api, smol):
    for schema, _ in CRASHING_SCHEMAS.values():
        assert (await post_json(api, CHAT, chat(response_format=schema_format(schema)))).status_code == 400
    await assert_still_answers(api)


async def test_a_schema_at_the_limits_still_constrains_the_answer(api, smol):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 1000}},
        "required": ["name"],
        "additionalProperties": False,
    }
    response = await post_json(api, CHAT, chat(response_format=schema_format(schema), max_tokens=60, temperature=0))
    assert response.status_code == 200
    answer = response.json()["choices"][0]["message"]["content"]
    if response.json()["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(answer)) == {"name"}
    assert answer.startswith('{ "name"') or answer.startswith('{"name"')


async def test_a_local_ref_in_a_tool_schema_resolves_in_the_forced_call(api, coder):
    """The forced call's grammar nests each tool's parameters; their #/ references follow them."""
    parameters = {
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/city"}},
        "required": ["city"],
        "$defs": {"city": {"type": "string", "maxLength": 20}},
    }
    body = {
        "model": CODER,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [weather_tool(parameters)],
        "tool_choice": "required",
        "max_tokens": 40,
        "temperature": 0,
    }
    response = await post_json(api, CHAT, body)
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_tool_parameter_of_5000_characters_under_required_is_refused(api, smol, stream):
    tool = weather_tool({"type": "object", "properties": {"city": {"type": "string", "maxLength": 5000}}})
    response = await post_json(api, CHAT, chat(tools=[tool], tool_choice="required", stream=stream))
    assert_refused(response, "tools", words="maxLength 5000")
    await assert_still_answers(api)


async def test_an_unresolvable_ref_in_a_tool_schema_is_refused_whatever_tool_choice_says(api, smol):
    tool = weather_tool({"type": "object", "properties": {"city": {"$ref": "#/definitions/City"}}})
    for choice in ("auto", "required"):
        response = await post_json(api, CHAT, chat(tools=[tool], tool_choice=choice))
        assert_refused(response, "tools", words="names nothing")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_responses_text_format_is_checked_like_response_format(api, smol, stream):
    body = {
        "model": SMOL,
        "input": "Give me JSON.",
        "max_output_tokens": 8,
        "stream": stream,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "maxLength": 5000}}},
    }
    assert_refused(await post_json(api, RESPONSES, body), "text.format", words="maxLength 5000")
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5000}}},
    }
    body = {"model": SMOL, "input": "Weather in Paris?", "tools": [tool], "tool_choice": "required", "stream": stream}
    assert_refused(await post_json(api, RESPONSES, body), "tools", words="maxLength 5000")
    await assert_still_answers(api)


async def test_the_worker_refuses_what_libllama_cannot_parse_as_the_last_line(api, smol, settings):
    """A web process with looser limits (another config) lets maxLength 1500 through; the worker
    checks with its own limits and has libllama parse the grammar: 400, no crash."""
    settings.HYPNOS = settings.HYPNOS.model_copy(
        update={"limits": settings.HYPNOS.limits.model_copy(update={"max_grammar_repetition": 5000})}
    )
    smol.config = smol.config.model_copy(
        update={"limits": smol.config.limits.model_copy(update={"max_grammar_repetition": 5000})}
    )
    for stream in (False, True):
        response = await post_json(
            api, CHAT, chat(response_format=schema_format({"type": "string", "maxLength": 1500}), stream=stream)
        )
        assert_refused(response, "response_format", words="libllama refuses")
    await assert_still_answers(api)


# The context check: counted in tokens in the worker, before `started`, so before any byte.


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
async def test_a_prompt_beyond_the_context_is_400_at_once_streamed_or_not(api, smol, route, stream):
    path, body, param = {
        "chat": (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
        "completions": (COMPLETIONS, {"prompt": TOO_LONG}, "prompt"),
        "responses": (RESPONSES, {"input": TOO_LONG}, "input"),
    }[route]
    started = time.perf_counter()
    response = await post_json(api, path, {"model": SMOL, "max_tokens": 8, "stream": stream, **body})
    error = assert_refused(response, param, code="context_length_exceeded", words="tokens")
    assert "8192" in error["message"]
    # Tokenising 9500 tokens takes milliseconds; their prefill would take most of a minute.
    assert time.perf_counter() - started < 10


async def test_the_context_grows_to_the_counted_tokens_when_the_estimate_falls_short(api, smol, settings):
    """CJK text tokenises to ~2.7 tokens a character, where the first estimate assumes three
    characters a token: 40 characters and max_tokens 2000 are estimated at 2013 tokens (a
    2048-token context), counted at ~2100. The worker grows the context before it starts."""
    with_limits(settings, max_tokens_cap=4096)
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(40))
    response = await post_json(
        api, CHAT, {"model": SMOL, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": cjk}]}
    )
    assert response.status_code == 200
    reading, chunks = read_in_background(response)
    try:
        assert await wait_until(lambda: len(chunks) >= 2, timeout=120)
    finally:
        reading.cancel()
    engine = smol.models[SMOL].engine
    assert engine is not None and engine.context_len > 2048


# Lone surrogates and empty prompts: 400 naming the field on every text route and embeddings.

SURROGATE_BODIES = {
    "chat": (
        CHAT,
        '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages.0.content",
    ),
    "chat stream": (
        CHAT,
        '{"model": "smollm2-135m", "stream": true, "messages": [{"role": "user", "content": "a\\udfffb"}]}',
        "messages.0.content",
    ),
    "completions": (COMPLETIONS, '{"model": "smollm2-135m", "prompt": "a\\ud800b"}', "prompt"),
    "responses": (RESPONSES, '{"model": "smollm2-135m", "input": "a\\ud800b"}', "input"),
    "responses items": (
        RESPONSES,
        '{"model": "smollm2-135m", "input": [{"type": "message", "role": "user", '
        '"content": [{"type": "input_text", "text": "a\\ud800b"}]}]}',
        "input.0.content.0.text",
    ),
    "embeddings": (EMBEDDINGS, '{"model": "all-minilm-l6-v2", "input": ["fine", "a\\ud800b"]}', "input.1"),
    "stop": (
        CHAT,
        '{"model": "smollm2-135m", "stop": ["\\ud800"], "messages": [{"role": "user", "content": "x"}]}',
        "stop.0",
    ),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
async def test_a_lone_surrogate_is_400_naming_the_field(api, smol, case):
    path, raw, param = SURROGATE_BODIES[case]
    response = await api.post(path, data=raw, content_type="application/json")
    assert_refused(response, param, words="surrogate")


async def test_a_surrogate_pair_is_a_character_and_passes(api, smol):
    raw = '{"model": "smollm2-135m", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}]}'
    assert (await api.post(CHAT, data=raw, content_type="application/json")).status_code == 200


@pytest.mark.parametrize("prompt", ["", [""]], ids=["string", "array"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_empty_completions_prompt_is_400(api, smol, prompt, stream):
    response = await post_json(api, COMPLETIONS, {"model": SMOL, "prompt": prompt, "stream": stream})
    assert_refused(response, "prompt", words="empty")
    await assert_still_answers(api)


async def test_a_streamed_refusal_sends_no_event_stream(api, smol):
    """Every refusal comes before the first byte: a JSON 400, not a 200 with an error chunk."""
    response = await post_json(
        api, CHAT, {"model": SMOL, "stream": True, "messages": [{"role": "user", "content": TOO_LONG}]}
    )
    assert response.status_code == 400 and not response.streaming
    ok = await post_json(api, CHAT, {"model": SMOL, "stream": True, "max_tokens": 3, "messages": PARIS_MESSAGES})
    assert ok.status_code == 200 and (await read_sse(ok))[-1] == "[DONE]"


def test_the_web_process_converts_a_schema_without_loading_libllama():
    """The web process measures the GBNF with llama-cpp-python's converter, loaded from its file:
    the distributed web process never imports an engine library."""
    code = (
        "import sys\nfrom hypnos_site.config import LimitsConfig\n"
        "from inference.web.common.grammar_limits import check_schema\n"
        "gbnf = check_schema({'type': 'string', 'maxLength': 10}, LimitsConfig(), 'response_format')\n"
        "print('char ::=' in gbnf, [m for m in sys.modules if m.split('.')[0] == 'llama_cpp'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True []"
