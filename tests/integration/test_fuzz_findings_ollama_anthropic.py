"""What the route fuzzer (tests/fuzz) and its probes found on the Ollama and Anthropic routes
(issue 17), one test per finding, through the real routes, the middlewares and the in-process
worker: each was a 500 or an answer in the wrong API's error shape before its fix."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]


def ollama_refusal(response: Any, status: int) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return str(body["error"])


def anthropic_refusal(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return str(body["error"]["message"])


@pytest.mark.parametrize("keep_alive", ["9999999999h", "1e309", "inf", "nan", 1e308, 10**30, 10**400])
async def test_a_keep_alive_past_the_longest_duration_is_a_400_and_the_status_stays_readable(api, keep_alive):
    # The worker took the duration, and the model's expiry (now + keep_alive) was a date no
    # datetime holds: GET /api/ps and /v1/memory/status were 500s until another keep_alive came.
    # An integer beyond any float was a 500 of its own.
    body = {"model": SMOL, "prompt": "Hi", "stream": False, "keep_alive": keep_alive, "options": {"num_predict": 1}}
    assert "keep_alive" in ollama_refusal(await post_json(api, "/api/generate", body), 400)
    assert (await api.get("/api/ps")).status_code == 200
    assert (await api.get("/v1/memory/status")).status_code == 200


async def test_a_keep_alive_just_short_of_the_longest_duration_shows_its_expiry(api):
    body = {"model": SMOL, "messages": HI, "stream": False, "keep_alive": 9.2e9, "options": {"num_predict": 1}}
    try:
        assert (await post_json(api, "/api/chat", body)).status_code == 200
        running = {m["model"]: m for m in (await api.get("/api/ps")).json()["models"]}
        assert int(running[f"{SMOL}:latest"]["expires_at"][:4]) > 2300  # about 291 years on
    finally:
        # Back to the session worker's default on a machine without a GPU: kept for good.
        await post_json(api, "/api/chat", {"model": SMOL, "messages": [], "keep_alive": -1})


@pytest.mark.parametrize("path", ["/", "/api/version", "/api/chat", "/api/nope"])
async def test_a_foreign_origin_on_the_ollama_routes_is_refused_in_ollamas_shape(api, path):
    # The Origin check runs before any view: its 403 was the /v1 envelope on every route.
    body = {"model": SMOL, "messages": HI, "stream": False}
    response = await post_json(api, path, body, origin="https://attacker.example")
    assert "server.allowed_origins" in ollama_refusal(response, 403)


@pytest.mark.parametrize("path", ["/v1/messages", "/api/v1/messages/count_tokens"])
async def test_a_foreign_origin_on_the_messages_routes_is_refused_in_anthropics_envelope(api, path):
    body = {"model": SMOL, "max_tokens": 1, "messages": HI}
    response = await post_json(api, path, body, origin="https://attacker.example")
    assert "server.allowed_origins" in anthropic_refusal(response, 403, "permission_error")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
async def test_a_json_body_of_another_label_is_read_and_what_does_not_parse_is_a_400_in_each_apis_shape(
    api, content_type
):
    # Ollama's quick-start posts with curl -d (url-encoded label), litellm with none: Ollama reads both.
    chat = json.dumps({"model": SMOL, "messages": HI, "stream": False, "options": {"num_predict": 1}})
    response = await api.post("/api/chat", data=chat, content_type=content_type)
    assert response.status_code == 200 and response.json()["done"] is True
    message = json.dumps({"model": SMOL, "max_tokens": 1, "messages": HI})
    response = await api.post("/v1/messages", data=message, content_type=content_type)
    assert response.status_code == 200 and response.json()["type"] == "message"
    assert "JSON" in ollama_refusal(await api.post("/api/chat", data="x=1", content_type=content_type), 400)
    refused = await api.post("/v1/messages", data="x=1", content_type=content_type)
    assert "JSON" in anthropic_refusal(refused, 400, "invalid_request_error")


async def test_a_host_the_server_does_not_answer_to_is_refused_in_the_routes_shape(api):
    response = await post_json(api, "/api/chat", {"model": SMOL, "messages": HI}, host="rebind.attacker.example")
    assert "server.allowed_hosts" in ollama_refusal(response, 400)
    response = await post_json(api, "/v1/messages", {"model": SMOL, "messages": HI}, host="rebind.attacker.example")
    assert "server.allowed_hosts" in anthropic_refusal(response, 400, "invalid_request_error")
    response = await post_json(
        api, "/v1/chat/completions", {"model": SMOL, "messages": HI}, host="rebind.attacker.example"
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "disallowed_host"
