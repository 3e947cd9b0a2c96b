"""Issue 12, the HTTP edge: JSON depth, multipart errors, NUL characters, Host and Origin checks,
content types, the WebSocket handshake and the deploy settings. Every refusal is the spec's
envelope with its status and an x-request-id, before any engine work."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tracemalloc
from typing import Any

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from hypnos_site.config import BASE_DIR, load_config
from hypnos_site.json_bodies import MAX_JSON_CONTAINERS, MAX_JSON_VALUES
from hypnos_site.settings import _allowed_hosts
from inference.web.common.middleware import RealtimeOriginValidator
from inference.web.common.parsers import MAX_JSON_DEPTH, JSONParser
from inference.web.openai.realtime import websocket_urlpatterns
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2}

# Every POST (and PUT) route that reads a JSON body.
JSON_ROUTES = [
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("post", "/v1/responses"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/audio/speech"),
    ("post", "/v1/audio/transcriptions"),
    ("post", "/v1/models"),
    ("put", "/v1/models/smollm2-135m"),
    ("post", "/v1/models/smollm2-135m/options"),
    ("post", "/v1/models/smollm2-135m/moe-offload"),
    ("post", "/v1/advisor"),
    ("post", "/v1/memory/tier"),
    ("post", "/v1/memory/kv-park"),
    ("post", "/v1/logs/level"),
    ("post", "/api/v1/load"),
    ("post", "/api/v1/unload"),
    ("post", "/api/v1/chat/completions"),
    ("post", "/internal/set"),
]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["content-type"] == "application/json"
    assert response["x-request-id"].startswith("req-")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def send(api, method: str, path: str, body: str, content_type: str = "application/json", **headers):
    return await getattr(api, method)(path, data=body, content_type=content_type, headers=headers)


# JSON depth


@pytest.mark.parametrize(("method", "path"), JSON_ROUTES)
async def test_json_nested_50000_deep_is_a_400_on_every_route(api, method, path):
    # 50,000 levels: past the C scanner's recursion, within MAX_JSON_CONTAINERS (100,000 levels
    # are refused by that count first, before anything is parsed).
    body = '{"model": "smollm2-135m", "messages": ' + nested(50_000) + "}"
    error = error_of(await send(api, method, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    deeper = '{"model": "smollm2-135m", "messages": ' + nested(MAX_JSON_CONTAINERS) + "}"
    assert "objects and arrays" in error_of(await send(api, method, path, deeper), 400)["message"]


async def test_json_just_past_the_depth_limit_is_a_400_and_at_it_parses(api):
    deep = error_of(await send(api, "post", "/v1/chat/completions", nested(MAX_JSON_DEPTH + 1)), 400)
    assert "deeper than" in deep["message"]
    at_limit = error_of(await send(api, "post", "/v1/chat/completions", nested(MAX_JSON_DEPTH)), 400)
    assert "deeper than" not in at_limit["message"]  # parsed; refused for its shape instead


def test_the_parser_counts_objects_and_arrays_alike():
    body = json.dumps({"a": [{"b": [{}]}]})  # depth 5
    assert JSONParser().parse(_Stream(body)) == {"a": [{"b": [{}]}]}
    tools = {"tools": [{"function": {"parameters": {"properties": {"x": {"type": "object"}}}}}]}
    assert JSONParser().parse(_Stream(json.dumps(tools))) == tools


# JSON size (issue 35): counted on the text, refused before anything is built


def _messages(item: str, count: int) -> str:
    return '{"model": "smollm2-135m", "messages": [' + ",".join([item] * count) + "]}"


async def _peak_of(call) -> tuple[Any, int]:  # type: ignore[no-untyped-def]
    """What `call` answers and the most memory Python held meanwhile above what it held before
    (tracemalloc: every allocation of the process's Python objects, pydantic's included)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        answer = await call()
        return answer, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def _large_bodies(settings: Any) -> None:
    """Bodies up to 64 MiB, for this test (the suite's config takes 1 MiB)."""
    with_limits(settings, max_body_bytes=64 << 20)
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 << 20


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        # The audit's bodies: 8 MiB of {} messages grew the process by 3.4 GB, 16 MiB of [] by 3.6 GB.
        (_messages("{}", 2_796_202), f"more than {MAX_JSON_CONTAINERS} objects and arrays"),
        (_messages("[]", 5_592_404), f"more than {MAX_JSON_CONTAINERS} objects and arrays"),
        (_messages("1", 2_000_000), f"more than {MAX_JSON_VALUES} values"),
    ],
    ids=["8MiB-of-objects", "16MiB-of-arrays", "4MiB-of-numbers"],
)
async def test_a_body_of_too_many_values_is_a_400_before_it_is_built(api, settings, body, limit):
    _large_bodies(settings)
    response, peak = await _peak_of(lambda: send(api, "post", "/v1/chat/completions", body))
    assert limit in error_of(response, 400)["message"]
    # Copies of the text, never objects built from it: the test client's bytes, the request's,
    # the request log's text, the parser's read and its count without strings (measured 5x;
    # before the count, 8 MiB of {} took 245 MB here and 3.4 GB in a server).
    assert peak < 8 * len(body), (peak, len(body))


async def test_the_costliest_body_within_the_limits_stays_bounded(api, settings):
    """Just under MAX_JSON_CONTAINERS empty messages: parsed, each refused by pydantic (an error
    apiece), a 400 within 512 MB (measured: about 80 MB)."""
    body = _messages("{}", MAX_JSON_CONTAINERS - 2)
    _large_bodies(settings)
    response, peak = await _peak_of(lambda: send(api, "post", "/v1/chat/completions", body))
    assert error_of(response, 400)["param"] == "messages.0.role"
    assert peak < 512 << 20, peak


def test_braces_and_commas_inside_strings_are_not_counted():
    prompt = "{[," * (MAX_JSON_VALUES + 1)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
    assert JSONParser().parse(_Stream(body))["messages"][0]["content"] == prompt
    escaped = json.dumps({"a": 'say \\"{' + "[" * MAX_JSON_CONTAINERS + '"'})
    assert JSONParser().parse(_Stream(escaped)) == json.loads(escaped)


class _Stream:
    def __init__(self, text: str):
        self.data = text.encode()

    def read(self) -> bytes:
        return self.data


# Multipart


async def test_multipart_without_a_boundary_is_a_400_in_the_envelope(api):
    response = await send(api, "post", "/v1/audio/transcriptions", "--x\r\n\r\n--x--", "multipart/form-data")
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "multipart/form-data" in error["message"] and "boundary" in error["message"]


async def test_multipart_with_more_fields_than_django_takes_is_a_400_not_a_500(api):
    parts = "".join(f'--b\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(1100))
    body = parts + "--b--\r\n"
    response = await send(api, "post", "/v1/audio/transcriptions", body, "multipart/form-data; boundary=b")
    error = error_of(response, 400)
    assert "fields" in error["message"]


async def test_a_url_encoded_form_is_no_longer_read_by_the_transcription_route(api):
    # Not read as a form: the route's JSON parser takes it and it does not parse (Lemonade's
    # whisper test_003 expects this 400).
    form = "application/x-www-form-urlencoded"
    response = await send(api, "post", "/v1/audio/transcriptions", "model=whisper-1", form)
    assert "JSON parse error" in error_of(response, 400)["message"]


async def test_a_route_that_reads_no_json_refuses_another_media_type_with_a_415(api):
    response = await send(api, "post", "/v1/images/edits", json.dumps({"model": "dcgan-faces"}), "text/plain")
    error = error_of(response, 415)
    assert error["code"] == "unsupported_media_type" and error["param"] == "Content-Type"
    assert "multipart/form-data" in error["message"]


# NUL characters


NUL_BODIES = [
    ("/v1/chat/completions", CHAT | {"model": "smollm2\u0000-135m"}),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "us\u0000er", "content": "Hi"}]}),
    ("/v1/chat/completions", CHAT | {"stop": ["\u0000"], "user": "\u0000"}),
    ("/v1/chat/completions", {"model\u0000": "smollm2-135m", "messages": PARIS_MESSAGES}),
    ("/v1/completions", {"model": "\u0000", "prompt": "Hi"}),
    ("/v1/responses", {"model": "smollm2-135m\u0000", "input": "Hi"}),
    ("/v1/embeddings", {"model": "all-minilm\u0000", "input": "Hi"}),
    ("/v1/models", {"id": "x\u0000", "modality": "text_generation", "engine": "ggml_llama", "weights_path": "\u0000"}),
    ("/v1/models/smollm2\u0000/options", {"temperature": 0.5}),
    ("/v1/memory/tier", {"model": "smollm2-135m\u0000", "target_tier": "tier2_pinned_ram"}),
    ("/v1/memory/tier", {"model": "smollm2-135m", "target_tier": "tier2\u0000"}),
    ("/v1/logs/level", {"level": "info\u0000"}),
    ("/api/v1/load", {"model_name": "smollm2\u0000"}),
    ("/v1/advisor", {"needs": ["chat\u0000"]}),
]


@pytest.mark.parametrize(("path", "body"), NUL_BODIES)
async def test_nul_characters_in_json_strings_are_answered_never_a_500(api, path, body):
    response = await post_json(api, path, body)
    assert response.status_code < 500, response.content[:300]
    if response.status_code >= 400:
        error_of(response, response.status_code)


# Host


class HostClient(AsyncClient):
    """AsyncClient whose `host` header replaces its own `testserver` (it sends both, joined)."""

    def _base_scope(self, **request):  # type: ignore[no-untyped-def]
        scope = super()._base_scope(**request)
        if sum(name == b"host" for name, _ in scope["headers"]) > 1:
            scope["headers"].remove((b"host", b"testserver"))
        return scope


@pytest.fixture
def browser(api) -> HostClient:
    return HostClient()


async def test_a_host_the_server_does_not_answer_to_is_a_400(browser):
    api = browser
    error = error_of(await post_json(api, "/v1/chat/completions", CHAT, host="rebind.attacker.example"), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "disallowed_host"
    assert "server.allowed_hosts" in error["message"]
    error_of(await api.get("/v1/models", headers={"host": "rebind.attacker.example:9999"}), 400)


@pytest.mark.parametrize("host", ["localhost:9999", "127.0.0.1:9999", "[::1]:9999", "localhost"])
async def test_loopback_hosts_are_answered(browser, host):
    api = browser
    assert (await api.get("/v1/models", headers={"host": host})).status_code == 200


async def test_a_listed_host_is_answered(browser, settings):
    api = browser
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "hypnos.lan"]
    assert (await api.get("/v1/models", headers={"host": "hypnos.lan:9999"})).status_code == 200


def test_the_allowed_hosts_are_loopback_the_bound_address_and_the_listed_ones(tmp_path):
    def hosts(server: str) -> list[str]:
        path = tmp_path / "hypnos.toml"
        path.write_text("[server]\n" + server + "\n")
        return _allowed_hosts(load_config({"HYPNOS_CONFIG": str(path)}))

    loopback = ["localhost", "127.0.0.1", "[::1]"]
    assert hosts("") == loopback
    assert hosts('host = "0.0.0.0"') == loopback
    assert hosts('host = "::"') == loopback
    assert hosts('host = "192.168.1.20"') == [*loopback, "192.168.1.20"]
    assert hosts('host = "fd00::1"') == [*loopback, "[fd00::1]"]
    assert hosts('host = "0.0.0.0"\nallowed_hosts = ["hypnos.lan", ".example.com"]') == [
        *loopback,
        "hypnos.lan",
        ".example.com",
    ]


# Origin and content type (cross-site requests without a preflight)


async def enabled(api) -> bool:
    listed = (await api.get("/v1/models")).json()["data"]
    return any(m["id"] == "smollm2-135m" for m in listed)


async def test_a_cross_site_text_plain_post_cannot_disable_a_model(api):
    response = await send(
        api, "post", "/v1/models/smollm2-135m/disable", "{}", "text/plain", origin="https://attacker.example"
    )
    error = error_of(response, 403)
    assert error["type"] == "permission_denied" and error["code"] == "origin_not_allowed"
    assert await enabled(api)


# Labels other than application/json: none, curl -d's url-encoded form (Ollama's quick-start),
# text/plain, and a multipart label on a route that reads only JSON.
OTHER_LABELS = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=b",
    "application/octet-stream",
]


@pytest.mark.parametrize("content_type", OTHER_LABELS)
async def test_a_json_body_is_read_whatever_its_label(api, content_type):
    """Issue 34 item 1: as Ollama does; a web page cannot use it, its Origin is refused above."""
    chat = await send(api, "post", "/v1/chat/completions", json.dumps(CHAT), content_type)
    assert chat.status_code == 200, chat.content[:300]
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    not_json = await send(api, "post", "/v1/chat/completions", "model=smollm2-135m", content_type)
    assert "JSON parse error" in error_of(not_json, 400)["message"]


async def test_a_json_body_without_a_content_type_is_read(api):
    response = await api.generic("POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    assert response.status_code == 200, response.content[:300]
    refused = await api.generic("POST", "/v1/chat/completions", b"not json")
    assert "JSON parse error" in error_of(refused, 400)["message"]


async def test_a_bodyless_post_without_a_content_type_still_works(api):
    try:
        assert (await api.generic("POST", "/v1/models/smollm2-135m/disable")).status_code == 200
        assert not await enabled(api)
    finally:
        assert (await api.generic("POST", "/v1/models/smollm2-135m/enable")).status_code == 200


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:9999", "http://testserver"])
async def test_loopback_and_same_origin_pages_may_post(api, origin):
    assert (await post_json(api, "/v1/chat/completions", CHAT, origin=origin)).status_code == 200


async def test_a_listed_origin_may_post_and_others_may_not(api, settings):
    settings.CORS_ALLOWED_ORIGIN_REGEXES = [*settings.CORS_ALLOWED_ORIGIN_REGEXES, r"^https://app\.example$"]
    assert (await post_json(api, "/v1/chat/completions", CHAT, origin="https://app.example")).status_code == 200
    for origin in ("https://app.example.attacker.example", "null", "http://localhost.attacker.example"):
        error = error_of(await post_json(api, "/v1/chat/completions", CHAT, origin=origin), 403)
        assert error["type"] == "permission_denied"


async def test_reading_is_not_refused_for_a_foreign_origin(api):
    # CORS decides what the page may read; a GET changes nothing.
    response = await api.get("/v1/models", headers={"origin": "https://attacker.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response


# WebSocket


REALTIME = RealtimeOriginValidator(URLRouter(websocket_urlpatterns))


async def handshake(*headers: tuple[bytes, bytes]) -> bool:
    communicator = WebsocketCommunicator(REALTIME, "/v1/realtime?intent=transcription", headers=list(headers))
    connected, _ = await communicator.connect(10)
    await communicator.disconnect()
    return connected


async def test_the_realtime_handshake_checks_origin_and_host(api):
    host = (b"host", b"127.0.0.1:9999")
    assert await handshake(host)  # no Origin: a client that is not a browser
    assert await handshake(host, (b"origin", b"http://localhost:3000"))
    assert not await handshake(host, (b"origin", b"https://attacker.example"))
    assert not await handshake(host, (b"origin", b"null"))
    assert not await handshake((b"host", b"rebind.attacker.example"))


# Deploy settings


def deploy_env(tmp_path, **extra: str) -> dict[str, str]:
    config = tmp_path / "hypnos.toml"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    config.write_text(
        f'[server]\napi_keys = ["sk-deploy"]\nallowed_hosts = ["hypnos.example.com"]\n'
        f'[server.tls]\ncert = "{cert}"\nkey = "{key}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    env.update(
        HYPNOS_CONFIG=str(config),
        HYPNOS_DATA_DIR=str(tmp_path / "data"),
        DJANGO_SETTINGS_MODULE="hypnos_site.settings",
        **extra,
    )
    return env


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120
    )


def test_check_deploy_is_clean_with_keys_and_tls(tmp_path):
    done = manage(deploy_env(tmp_path), "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


def test_the_secret_key_is_made_once_kept_private_and_overridable(tmp_path):
    env = deploy_env(tmp_path)
    show = ["shell", "--no-imports", "-c", "from django.conf import settings; print(settings.SECRET_KEY)"]
    first = manage(env, *show)
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "data" / "secret_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert first.stdout.strip() == key_file.read_text().strip() and len(first.stdout.strip()) >= 50
    assert str(tmp_path) not in first.stdout
    assert manage(env, *show).stdout == first.stdout
    (tmp_path / "other").mkdir()
    other = deploy_env(tmp_path / "other")
    assert manage(other, *show).stdout != first.stdout
    assert manage(env | {"HYPNOS_SECRET_KEY": "x" * 60}, *show).stdout.strip() == "x" * 60


async def test_responses_carry_the_security_headers(api):
    response = await api.get("/v1/models")
    assert response["x-content-type-options"] == "nosniff"
    assert response["x-frame-options"] == "DENY"
