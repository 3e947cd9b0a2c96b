"""Issue 12, authorisation: what a key that is not an admin key may change, read and see (the
routes that change state, the request log, /metrics, absolute paths), the staging 503s of the
placement routes, the realtime socket's close code and the record of a cancelled stream. Real
views, the in-process worker and SmolLM2; a second, never started Worker stands for startup
staging."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings as django_settings
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RegexPattern
from prometheus_client.parser import text_string_to_metric_families

import hypnos_site.metrics as metrics_module
from hypnos_site.config import KeyConfig
from inference.web.anthropic import views as anthropic_views
from inference.web.common.views import UnknownRouteView
from inference.web.openai import views
from inference.web.openai.realtime import websocket_urlpatterns
from inference.worker import Worker
from logs import views as log_views
from logs.store import levels
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until, with_server

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
CHAT = {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2}
ADMIN, PLAIN, OTHER = "sk-hardening-admin", "sk-hardening-plain", "sk-hardening-other"
CHANGING_METHODS = ("post", "put", "patch", "delete")
# Routes that compute an answer and change nothing, so any valid key may call them: the
# inference routes (spec §7-§10), the advisor (spec §6, a recommendation) and the catch-all 404.
OPEN_TO_EVERY_KEY = {
    views.ChatCompletionsView,
    views.CompletionsView,
    views.ResponsesView,
    views.EmbeddingsView,
    views.AudioTranscriptionsView,
    views.AudioSpeechView,
    views.AdvisorView,
    UnknownRouteView,
    views.DocumentConvertView,
    views.EntitiesView,
    views.ImagesView,
    views.ImageFormView,
    views.ImageUpscaleView,
    # A key deletes only its own documents (another key's are a 404: logs/pictures.py).
    log_views.DocumentView,
    # Anthropic's Messages API (issue 17).
    anthropic_views.MessagesView,
    anthropic_views.CountTokensView,
    # The Files API: a key uploads and deletes only its own files (logs/files.py).
    views.FilesView,
    views.FileView,
    # The Batch API: a key creates and cancels only its own batches (logs/batches.py).
    views.BatchesView,
    views.BatchCancelView,
}
# What a route's URL parameters are filled with when it is called.
SAMPLE_ARGUMENTS = {
    "model_id": SMOL,
    "request_id": "req-" + "0" * 32,
    "document_id": "doc-" + "0" * 32,
    "index": "1",
    "key": "no-such-key",
    "file_id": "file-" + "0" * 32,
    "batch_id": "batch_" + "0" * 32,
}


@pytest.fixture(autouse=True)
def keys(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An admin key and two plain keys; the configured log level; no counted metrics."""
    with_server(
        settings, api_keys=[ADMIN], keys=[KeyConfig(key=PLAIN, label="plain"), KeyConfig(key=OTHER, label="other")]
    )
    monkeypatch.setattr(metrics_module, "_memory_counters", metrics_module.MemoryCounters())
    levels.reset()
    yield
    levels.reset()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The error of a response that must be the spec's envelope with `status` and a request id."""
    assert response.status_code == status, (response.status_code, response.content)
    assert response["x-request-id"].startswith("req-")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def assert_admin_only(response: Any) -> None:
    assert error_of(response, 403) | {"message": ""} == {
        "message": "",
        "type": "permission_denied",
        "param": None,
        "code": "permission_denied",
    }
    assert "needs an admin key" in response.json()["error"]["message"]


# -- every route that changes state, found in the URL table -----------------------------------


def _patterns(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, URLPattern]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _patterns(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def api_routes() -> list[tuple[str, str, type]]:
    """(URL to call, route as written, view class) of every /v1, /api/v1 and /internal route."""
    found = []
    for route, pattern in _patterns(get_resolver().url_patterns):
        if not route.startswith(("v1/", "api/v1/", "internal/")):
            continue
        view = getattr(pattern.callback, "view_class", None) or getattr(pattern.callback, "cls", None)
        assert view is not None, f"{route}: a function view; give it a class with permission_classes"
        if isinstance(pattern.pattern, RegexPattern):
            url = route[: -len(str(pattern.pattern))] + "no-such-route"
        else:
            url = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: SAMPLE_ARGUMENTS[m.group(1)], route)
        found.append(("/" + url, route, view))
    return found


def changing_calls() -> list[tuple[str, str, str, type]]:
    return [
        (method, url, route, view)
        for url, route, view in api_routes()
        for method in CHANGING_METHODS
        if hasattr(view, method)
    ]


def test_the_walk_finds_the_routes_that_change_state():
    walked = {(method, route) for method, _, route, _ in changing_calls()}
    for expected in [
        ("post", "v1/models"),
        ("delete", "api/v1/models/<path:model_id>"),
        ("post", "v1/models/<path:model_id>/disable"),
        ("post", "v1/memory/kv-park"),
        ("delete", "v1/logs"),
        ("post", "api/v1/logs/level"),
        ("post", "api/v1/load"),
        ("post", "internal/set"),
        ("delete", "v1/models/<path:model_id>/options"),
    ]:
        assert expected in walked


async def test_every_route_that_changes_state_refuses_a_plain_key(api, use_worker):
    # A worker still staging: were a route to act for the plain key, it would act on this one.
    use_worker(Worker(django_settings.HYPNOS))
    calls = changing_calls()
    refused, served = [], []
    for method, url, route, view in calls:
        response = await api.generic(
            method.upper(), url, data="{}", content_type="application/json", headers=bearer(PLAIN)
        )
        if view in OPEN_TO_EVERY_KEY:
            assert response.status_code != 403, (method, route, response.content)
            served.append(route)
            continue
        assert response.status_code == 403, f"{method.upper()} /{route} answered {response.status_code} to a plain key"
        assert_admin_only(response)
        # The admin key passes the same check (its answer is the route's own: 400, 404, 503...).
        admitted = await api.generic(
            method.upper(), url, data="{}", content_type="application/json", headers=bearer(ADMIN)
        )
        assert admitted.status_code != 403, (method, route, admitted.content)
        refused.append(route)
    assert len(refused) >= 27 and "v1/chat/completions" in served


async def test_a_plain_key_cannot_disable_the_admins_model_or_move_it(api, worker):
    for path, body in [
        (f"/v1/models/{SMOL}/disable", {}),
        (f"/v1/models/{SMOL}/enable", {}),
        ("/v1/memory/tier", {"model": SMOL, "target_tier": "tier3_nvme_ssd"}),
        ("/v1/memory/kv-park", {"enabled": False}),
        (f"/v1/models/{SMOL}/moe-offload", {"mode": "auto"}),
        ("/api/v1/unload", {"model_name": SMOL}),
        ("/api/v1/load", {"model_name": SMOL}),
    ]:
        assert_admin_only(await post_json(api, path, body, **bearer(PLAIN)))
    model = (await api.get(f"/v1/models/{SMOL}", headers=bearer(PLAIN))).json()
    assert model["enabled"] is True and model["current_tier"] == "tier1_gpu_vram"
    assert (await api.get("/v1/memory/kv-park", headers=bearer(PLAIN))).status_code == 200


async def test_with_no_key_configured_the_changing_routes_stay_open(api, settings):
    with_server(settings, api_keys=[], keys=[])
    assert (await post_json(api, "/v1/logs/level", {"level": "warn"})).json() == {"level": "warn"}
    assert (await api.delete("/v1/logs")).json() == {"cleared": True}


# -- the request log ----------------------------------------------------------------------------


async def test_a_plain_key_reads_only_its_own_log_records(api):
    mine = await post_json(api, "/v1/chat/completions", CHAT, **bearer(PLAIN))
    theirs = await post_json(api, "/v1/chat/completions", CHAT, **bearer(OTHER))
    admins = await post_json(api, "/v1/chat/completions", CHAT, **bearer(ADMIN))
    assert {mine.status_code, theirs.status_code, admins.status_code} == {200}

    own = (await api.get("/v1/logs", headers=bearer(PLAIN))).json()
    assert [r["id"] for r in own["records"]] == [mine["x-request-id"]] and own["stored"] == 1
    assert (await api.get("/v1/logs?key=other", headers=bearer(PLAIN))).json()["records"] == []
    assert (await api.get(f"/v1/logs/{mine['x-request-id']}", headers=bearer(PLAIN))).json()["key"] == "plain"
    hidden = await api.get(f"/v1/logs/{theirs['x-request-id']}", headers=bearer(PLAIN))
    assert error_of(hidden, 404)["type"] == "not_found"
    hidden = await api.get(f"/api/v1/logs/{admins['x-request-id']}", headers=bearer(PLAIN))
    assert error_of(hidden, 404)["type"] == "not_found"

    every = (await api.get("/v1/logs", headers=bearer(ADMIN))).json()
    assert {r["key"] for r in every["records"]} == {"plain", "other", "key-" + _sha8(ADMIN)}
    assert (await api.get(f"/v1/logs/{theirs['x-request-id']}", headers=bearer(ADMIN))).status_code == 200


async def test_only_an_admin_key_sets_the_level_or_clears_the_log(api):
    await post_json(api, "/v1/chat/completions", CHAT, **bearer(OTHER))
    assert_admin_only(await post_json(api, "/v1/logs/level", {"level": "trace"}, **bearer(PLAIN)))
    assert_admin_only(await api.delete("/v1/logs", headers=bearer(PLAIN)))
    assert_admin_only(await api.delete("/api/v1/logs", headers=bearer(PLAIN)))
    assert await levels.get() == "info"
    assert (await api.get("/v1/logs", headers=bearer(ADMIN))).json()["stored"] == 1
    # The plain key never reads the other key's text, even once an admin captures at trace.
    assert (await post_json(api, "/v1/logs/level", {"level": "trace"}, **bearer(ADMIN))).json() == {"level": "trace"}
    await post_json(api, "/v1/chat/completions", CHAT, **bearer(OTHER))
    records = (await api.get("/v1/logs", headers=bearer(PLAIN))).json()["records"]
    assert records == []
    assert (await api.delete("/v1/logs", headers=bearer(ADMIN))).json() == {"cleared": True}


async def test_a_cancelled_stream_is_logged_with_what_it_generated(api):
    stream = await post_json(api, "/v1/chat/completions", CHAT | {"stream": True, "max_tokens": 60}, **bearer(PLAIN))
    reader, chunks = read_in_background(stream)
    try:
        assert await wait_until(lambda: len(chunks) >= 6, timeout=60)
    finally:
        reader.cancel()
    delivered = sum(
        1
        for chunk in b"".join(chunks).split(b"\n\n")
        if b'"content": "' in chunk and json.loads(chunk[len(b"data: ") :])["choices"][0]["delta"].get("content")
    )
    record = await logged(api, stream["x-request-id"])
    assert (record["status"], record["stream"], record["finish_reason"], record["level"]) == (
        200,
        True,
        "cancelled",
        "warn",
    )
    assert record["error"] == "the client disconnected before the response was complete"
    # The middleware read a chunk the reader may not have taken yet when it was cancelled, and
    # a chunk may carry several tokens (the transport joins deltas when the loop lags).
    assert delivered >= 4 and delivered <= record["tokens_out"] < 60


async def test_a_finished_call_is_logged_with_its_finish_reason(api):
    whole = await post_json(api, "/v1/chat/completions", CHAT, **bearer(PLAIN))
    record = (await api.get(f"/v1/logs/{whole['x-request-id']}", headers=bearer(PLAIN))).json()
    assert (record["finish_reason"], record["tokens_out"]) == ("length", 2)


async def logged(api: Any, request_id: str, timeout: float = 30.0) -> dict[str, Any]:
    """The record of `request_id` once it is stored (a call the client dropped is logged just after)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (response := await api.get(f"/v1/logs/{request_id}", headers=bearer(PLAIN))).status_code == 404:
        assert asyncio.get_running_loop().time() < deadline, "the call was not logged"
        await asyncio.sleep(0.02)
    return response.json()


def _sha8(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:8]


# -- what a plain key sees -----------------------------------------------------------------------


async def scrape(api: Any, **headers: str) -> set[str]:
    """The family names GET /metrics shows."""
    response = await api.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    return {family.name for family in text_string_to_metric_families(response.content.decode())}


async def test_the_key_families_of_metrics_are_shown_to_admin_keys_only(api, settings):
    await post_json(api, "/v1/chat/completions", CHAT, **bearer(PLAIN))
    key_families = {
        "hypnos_api_key_requests",
        "hypnos_api_key_rejections",
        "hypnos_api_key_tokens",
        "hypnos_api_key_tokens_today",
    }
    for headers in [{}, bearer(PLAIN), bearer("sk-unknown")]:
        shown = await scrape(api, **headers)
        assert "hypnos_http_requests" in shown and not shown & key_families
        page = (await api.get("/metrics", headers=headers)).content.decode()
        assert 'key="plain"' not in page and "hypnos_api_key" not in page
    assert key_families <= await scrape(api, **bearer(ADMIN))
    with_server(settings, metrics_require_auth=True)
    assert not await scrape(api, **bearer(PLAIN)) & key_families
    with_server(settings, api_keys=[], keys=[], metrics_require_auth=False)
    assert key_families <= await scrape(api)


async def test_a_plain_key_sees_paths_relative_to_models_dir(api, settings):
    models_dir = str(settings.HYPNOS.models_dir)
    weights = settings.HYPNOS.weights_file(settings.HYPNOS.models[0])
    plain_files = (await api.get(f"/v1/models/{SMOL}/files", headers=bearer(PLAIN))).json()["data"][0]
    assert plain_files["path"] == str(weights.relative_to(models_dir)) and plain_files["exists"] is True
    admin_files = (await api.get(f"/v1/models/{SMOL}/files", headers=bearer(ADMIN))).json()["data"][0]
    assert admin_files["path"] == str(weights)

    health = (await api.get("/api/v1/health", headers=bearer(PLAIN))).json()
    assert {m["model_name"]: m["checkpoint"] for m in health["all_models_loaded"]}[SMOL] == plain_files["path"]
    health = (await api.get("/api/v1/health", headers=bearer(ADMIN))).json()
    assert {m["model_name"]: m["checkpoint"] for m in health["all_models_loaded"]}[SMOL] == str(weights)

    assert (await api.get("/v1/models/catalog", headers=bearer(PLAIN))).json()["models_dir"] is None
    assert (await api.get("/v1/models/catalog", headers=bearer(ADMIN))).json()["models_dir"] == models_dir

    for path in [
        "/v1/models/catalog",
        "/v1/memory/status",
        "/api/v1/health",
        f"/v1/models/{SMOL}/files",
        "/v1/models",
        f"/v1/models/{SMOL}",
        f"/v1/models/{SMOL}/options",
        "/v1/memory/kv-park",
    ]:
        response = await api.get(path, headers=bearer(PLAIN))
        assert response.status_code == 200, (path, response.content)
        page = response.content.decode()
        assert models_dir not in page and str(settings.HYPNOS.data_dir) not in page, path


def test_hidden_paths_keep_what_is_not_a_server_path(settings):
    from inference.web.common.catalog import hide_paths

    models_dir, home = settings.HYPNOS.models_dir, __import__("pathlib").Path.home()
    shown = hide_paths(
        {"a": [f"cannot read {models_dir}/x/y.gguf: gone", f"{home}/notes", f"{home}2/x", "http://host/v1/models"]},
        admin=False,
    )
    assert shown == {"a": ["cannot read x/y.gguf: gone", "~/notes", f"{home}2/x", "http://host/v1/models"]}
    assert hide_paths({"p": str(models_dir)}, admin=True) == {"p": str(models_dir)}


# -- startup staging -------------------------------------------------------------------------------


async def test_while_staging_disable_moe_offload_and_kv_park_are_503(api, settings, use_worker):
    staging = use_worker(Worker(settings.HYPNOS))  # never started: still staging
    assert not staging.ready
    for path, body in [
        (f"/v1/models/{SMOL}/disable", {}),
        (f"/v1/models/{SMOL}/enable", {}),
        (f"/v1/models/{SMOL}/moe-offload", {"mode": "auto"}),
        ("/v1/memory/kv-park", {"enabled": True}),
        ("/v1/memory/kv-park", {"max_bytes": 1}),
    ]:
        response = await post_json(api, path, body, **bearer(ADMIN))
        error = error_of(response, 503)
        assert error["type"] == "model_not_available" and "pre-staging" in error["message"], path
        assert response["Retry-After"] == "5"
    assert staging.models[SMOL].enabled is True
    parking = staging.kv_parking.status()
    assert (parking["enabled"], parking["max_bytes"]) == (
        settings.HYPNOS.hardware.kv_park,
        settings.HYPNOS.hardware.kv_park_max_bytes,
    )
    # Reading stays open (spec §3).
    assert (await api.get("/v1/memory/kv-park", headers=bearer(PLAIN))).status_code == 200


# -- realtime --------------------------------------------------------------------------------------


async def test_the_realtime_socket_closes_with_1008_on_a_bad_key(api):
    app = URLRouter(websocket_urlpatterns)
    for path, headers in [
        ("/v1/realtime?intent=transcription", []),
        ("/v1/realtime?api_key=sk-wrong", []),
        ("/v1/realtime", [(b"authorization", b"Bearer sk-wrong")]),
    ]:
        communicator = WebsocketCommunicator(app, path, headers=headers)
        connected, _ = await communicator.connect()
        assert connected
        event = await communicator.receive_json_from(10)
        assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
        # A client that sends before it reads the refusal gets the same close, not a crash.
        await communicator.send_json_to({"type": "input_audio_buffer.append", "audio": ""})
        closed = await communicator.receive_output(10)
        assert closed == {"type": "websocket.close", "code": 1008}
        await communicator.wait()
