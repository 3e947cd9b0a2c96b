"""GET /v1/openapi.json and /docs: the schema describes every route of the URL table, the spec's
request and error examples validate against it, and the docs page loads its vendored assets."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import STATICFILES_STORAGE_ALIAS, settings
from django.contrib.staticfiles.storage import staticfiles_storage
from django.core.files.storage import storages
from django.test import AsyncClient, Client
from django.urls import URLPattern, URLResolver, get_resolver, set_script_prefix
from django.urls.resolvers import RoutePattern
from django.utils.functional import empty
from jsonschema import Draft202012Validator

from hypnos_site.handler import PooledASGIHandler
from tests.integration.conftest import with_server

pytestmark = pytest.mark.django_db

SPEC = Path(settings.BASE_DIR).parent / "shared" / "spec" / "hypnos-api.md"
# The spec's request examples of the routes that parse their body with a protocol model: the
# route, the method, and words found only in that example's code block.
REQUEST_EXAMPLES = [
    ("/v1/advisor", "post", '"needs": ["chat", "voice", "documents"]'),
    ("/v1/models/{model_id}/moe-offload", "post", '{ "mode": "auto" }'),
    ("/v1/chat/completions", "post", "Explain sliding-window attention"),
    ("/v1/chat/completions", "post", "What's the weather in Paris?"),
    ("/v1/embeddings", "post", '"input": ["first text", "second text"]'),
    ("/v1/audio/speech", "post", '"input": "Hello from Hypnos."'),
    ("/v1/images/generations", "post", '"prompt": "a lighthouse at dawn, oil painting"'),
    ("/v1/entities", "post", "Mario Rossi works in Milan for Ferrari."),
    ("/v1/memory/tier", "post", '"target_tier": "tier2_pinned_ram"'),
    ("/v1/memory/kv-park", "post", "POST /v1/memory/kv-park"),
]
# Chat messages shown alone (a content-parts message, an assistant's tool call and its answer).
MESSAGE_EXAMPLES = ["What is in this picture, and what does the speaker say?", '"role": "tool", "tool_call_id"']
# The spec's error bodies (the others are abbreviated: "a" | "b" is not JSON).
ERROR_EXAMPLES = ["Missing API key.", "Hypnos is still pre-staging", "<human readable>"]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    response = Client().get("/v1/openapi.json")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    return response.json()


def _routes(patterns: list[Any], prefix: str = "") -> list[str]:
    """Every route of the URL table but the admin's pages and the catch-all expressions, as
    OpenAPI writes paths (`/v1/models/{model_id}`)."""
    found = []
    for entry in patterns:
        if not isinstance(entry.pattern, RoutePattern) or (prefix + str(entry.pattern)).startswith("admin/"):
            continue
        if isinstance(entry, URLResolver):
            found += _routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            found.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", prefix + str(entry.pattern)))
    return found


def _spec_block(words: str) -> str:
    """The one `json` code block of the spec that holds `words`, without a leading
    `METHOD /path` line. Without the spec beside the checkout the test skips, and fails under CI,
    where ../shared is always there."""
    if not SPEC.is_file():
        missing = f"the spec is not beside this checkout ({SPEC})"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    blocks = re.findall(r"^json\n(.*?)(?:\n\n|\Z)", SPEC.read_text(), flags=re.M | re.S)
    matching = [block for block in blocks if words in block]
    assert len(matching) == 1, f"{len(matching)} spec examples hold {words!r}"
    return re.sub(r"^(GET|POST|PUT|DELETE) /\S+\n", "", matching[0])


def _first_json(text: str) -> Any:
    """The JSON value the block starts with (a table or prose may follow it)."""
    value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    return value


def _json_objects(text: str) -> list[Any]:
    """The objects the block starts with, separated by commas (messages shown one after another)."""
    found, at = [], 0
    while (at := _skip(text, at)) < len(text) and text[at] == "{":
        value, at = json.JSONDecoder().raw_decode(text, at)
        found.append(value)
    return found


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \n,":
        at += 1
    return at


def _validator(schema: dict[str, Any], part: dict[str, Any]) -> Draft202012Validator:
    # The document's components beside the part, so its "#/components/schemas/..." refs resolve.
    return Draft202012Validator({**part, "components": schema["components"]})


def _errors(validator: Draft202012Validator, instance: Any) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(instance)]


def test_every_route_of_the_url_table_is_in_the_schema(schema):
    routes = _routes(get_resolver().url_patterns)
    assert "/v1/chat/completions" in routes and "/api/chat" in routes and "/api/v1/load" in routes
    assert sorted(set(routes) - set(schema["paths"])) == []
    assert set(schema["paths"]) <= set(routes)


def test_it_gives_each_route_its_methods_and_the_error_envelope(schema):
    paths = schema["paths"]
    assert set(paths["/v1/models"]) == {"get", "head", "post"}
    assert set(paths["/v1/models/{model_id}"]) >= {"get", "put", "delete"}
    assert paths["/v1/models/{model_id}"]["parameters"][0]["name"] == "model_id"
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, item in paths.items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            assert "default" in operation["responses"], (path, method)
            if path.startswith("/v1/") and not path.startswith("/v1/messages"):
                assert operation["responses"]["default"]["content"]["application/json"]["schema"] == error


def test_request_bodies_come_from_the_protocol_models(schema):
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    transcription = schema["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    assert set(transcription) == {"multipart/form-data", "application/json"}


def test_streaming_answers_are_described(schema):
    def answers(path: str) -> dict[str, Any]:
        return schema["paths"][path]["post"]["responses"]["200"]

    assert "text/event-stream" in answers("/v1/chat/completions")["content"]
    assert "stream" in answers("/v1/chat/completions")["description"]
    assert "text/event-stream" in answers("/v1/documents/convert")["content"]
    assert "application/x-ndjson" in answers("/api/chat")["content"]
    assert "audio/wav" in answers("/v1/audio/speech")["content"]
    assert "text/event-stream" not in answers("/v1/embeddings")["content"]


def test_it_needs_no_key_and_marks_the_open_routes(schema, settings):
    with_server(settings, api_keys=["sk-test-openapi"])
    assert Client().get("/v1/models").status_code == 401
    assert Client().get("/v1/openapi.json").status_code == 200
    assert Client().get("/v1/openapi.json", headers={"authorization": "Bearer sk-wrong"}).status_code == 200
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert "security" not in schema["paths"]["/v1/chat/completions"]["post"]
    assert {"bearer": []} in schema["security"]


def test_the_schema_is_openapi_3_1_with_valid_json_schemas(schema):
    assert schema["openapi"].startswith("3.1")
    for component in schema["components"]["schemas"].values():
        Draft202012Validator.check_schema(component)
    assert schema["servers"] == [{"url": "/"}]


@pytest.mark.parametrize(("path", "method", "words"), REQUEST_EXAMPLES)
def test_the_spec_request_examples_validate(schema, path, method, words):
    body = _spec_block(words)
    content = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    assert content["$ref"].startswith("#/components/schemas/")
    assert _errors(_validator(schema, content), _first_json(body)) == []


@pytest.mark.parametrize("words", MESSAGE_EXAMPLES)
def test_the_spec_chat_message_examples_validate(schema, words):
    messages = _json_objects(_spec_block(words))
    assert messages
    validator = _validator(schema, {"$ref": "#/components/schemas/ChatMessage"})
    assert [_errors(validator, message) for message in messages] == [[] for _ in messages]


@pytest.mark.parametrize("words", ERROR_EXAMPLES)
def test_the_spec_error_examples_validate_against_the_envelope(schema, words):
    validator = _validator(schema, {"$ref": "#/components/schemas/ErrorResponse"})
    assert _errors(validator, _first_json(_spec_block(words))) == []


def test_a_body_the_model_refuses_fails_the_schema_too(schema):
    request = schema["paths"]["/v1/memory/tier"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert _errors(_validator(schema, request), {"target_tier": "tier2_pinned_ram"}) != []


async def test_the_docs_page_loads_swagger_ui_from_this_server():
    client = AsyncClient()
    page = await client.get("/docs")
    assert page.status_code == 200 and page["Content-Type"].startswith("text/html")
    html = page.content.decode()
    assert 'data-schema-url="/v1/openapi.json"' in html
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert sorted(asset.rsplit("/", 1)[1] for asset in assets) == ["docs.js", "swagger-ui-bundle.js", "swagger-ui.css"]
    for asset in assets:
        response = await client.get(asset)
        assert response.status_code == 200, asset
        assert [chunk async for chunk in response.streaming_content]
    assert not re.search(r'(?:src|href)="https?://', html), "no CDN"


async def _asgi_get(app: PooledASGIHandler, path: str, root_path: str) -> tuple[int, dict[str, str], bytes]:
    """A GET through the ASGI handler daphne runs, as a reverse proxy that mounts the server
    under `root_path` passes it (daphne's --root-path, the ASGI scope's root_path)."""
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": root_path + path,
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 9999),
    }
    sent: list[dict[str, Any]] = []
    request = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await asyncio.Event().wait()  # the client stays: Django cancels this when it has answered
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await app(scope, receive, send)
    finally:
        set_script_prefix("/")
    start = sent[0]
    headers = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    return start["status"], headers, b"".join(message.get("body", b"") for message in sent[1:])


@pytest.fixture
def fresh_static_storage() -> Iterator[None]:
    """The static URL and storage made anew, as in a server process behind a proxy: Django keeps
    them, the script prefix included, from their first use."""

    def forget() -> None:
        settings.__dict__.pop("STATIC_URL", None)
        storages._storages.pop(STATICFILES_STORAGE_ALIAS, None)
        staticfiles_storage._wrapped = empty  # type: ignore[attr-defined]

    forget()
    yield
    forget()


async def test_behind_a_reverse_proxy_prefix_the_page_and_schema_carry_it(fresh_static_storage):
    app = PooledASGIHandler()
    status, _, html = await _asgi_get(app, "/docs", "/hypnos")
    assert status == 200
    assert b'data-schema-url="/hypnos/v1/openapi.json"' in html
    assets = re.findall(rb'(?:src|href)="([^"]+)"', html)
    assert assets and all(asset.startswith(b"/hypnos/static/docs/") for asset in assets)
    for asset in assets:
        status, headers, body = await _asgi_get(app, asset.decode().removeprefix("/hypnos"), "/hypnos")
        assert status == 200 and body, asset
    status, headers, body = await _asgi_get(app, "/v1/openapi.json", "/hypnos")
    assert json.loads(body)["servers"] == [{"url": "/hypnos"}]
    status, headers, _ = await _asgi_get(app, "/static/admin/css/base.css", "/hypnos")
    assert status == 200 and headers["content-type"].startswith("text/css")
