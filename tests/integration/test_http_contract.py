"""Cross-cutting behaviour of every route: errors, limits, CORS, keys, readiness."""

from __future__ import annotations

import json
import threading

import pytest
from django.core.management import call_command
from django.test import AsyncClient

from hypnos_site.config import HypnosConfig
from inference.engines.base import ChatResult, Engine
from inference.worker import Worker
from memory.planner import Footprint
from memory.tiers import MemoryTier, Placement
from models_registry.authentication import db_keys_present
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_sse, with_server

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2}


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_unknown_model_is_a_404_model_not_found(api):
    response = await post_json(api, URL, CHAT | {"model": "nope"})
    assert response.status_code == 404
    assert error_of(response) | {"message": ""} == {
        "message": "",
        "type": "model_not_found",
        "param": "model",
        "code": "model_not_found",
    }


async def test_malformed_json_is_a_400(api):
    response = await api.post(URL, data="{not json", content_type="application/json")
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


async def test_a_wrong_type_is_a_400_naming_the_field(api):
    response = await post_json(api, URL, CHAT | {"temperature": "hot"})
    assert response.status_code == 400
    assert error_of(response)["param"] == "temperature"


async def test_too_many_prompt_characters_is_a_400(api, settings):
    limit = settings.HYPNOS.limits.max_prompt_chars
    response = await post_json(api, URL, CHAT | {"messages": [{"role": "user", "content": "a" * (limit + 1)}]})
    assert response.status_code == 400
    assert "max_prompt_chars" in error_of(response)["message"]


async def test_a_body_above_the_limit_is_a_413_in_plain_text(api, settings):
    big = json.dumps(CHAT | {"pad": "x" * settings.HYPNOS.limits.max_body_bytes})
    response = await api.post(URL, data=big, content_type="application/json")
    assert response.status_code == 413
    assert response["content-type"].startswith("text/plain")
    assert response["x-request-id"].startswith("req-")


@pytest.mark.parametrize("method", ["get", "post", "delete"])
async def test_an_unknown_v1_path_is_a_json_404(api, method):
    response = await getattr(api, method)("/v1/no/such/route")
    assert response.status_code == 404
    assert response["content-type"] == "application/json"
    assert error_of(response)["type"] == "not_found"
    assert response["x-request-id"].startswith("req-")


async def test_a_wrong_method_is_a_json_405(api):
    response = await api.get(URL)
    assert response.status_code == 405
    assert error_of(response)["type"] == "invalid_request_error"


async def test_loopback_origins_may_call_the_api(api):
    response = await api.options(
        URL, headers={"origin": "http://localhost:5173", "access-control-request-method": "POST"}
    )
    assert response["access-control-allow-origin"] == "http://localhost:5173"
    assert "x-request-id" in response["access-control-expose-headers"]


async def test_other_origins_may_not_unless_listed(api, settings):
    headers = {"origin": "http://example.com", "access-control-request-method": "POST"}
    assert "access-control-allow-origin" not in await api.options(URL, headers=headers)


async def test_without_keys_the_api_is_open(api):
    assert (await post_json(api, URL, CHAT)).status_code == 200


async def test_a_missing_key_is_a_401_with_the_spec_body(api, settings):
    with_server(settings, api_keys=["sk-secret"])
    response = await post_json(api, URL, CHAT)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="hypnos"'
    assert error_of(response) == {
        "message": "Missing API key. Send it as `Authorization: Bearer <key>` (server.api_keys).",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }


async def test_a_wrong_key_is_a_401_and_the_right_one_passes(api, settings):
    with_server(settings, api_keys=["sk-secret"])
    wrong = await post_json(api, URL, CHAT, authorization="Bearer sk-wrong")
    assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
    right = await post_json(api, URL, CHAT, authorization="bearer   sk-secret ")
    assert right.status_code == 200


async def test_health_and_ready_stay_open_with_keys(api, settings):
    with_server(settings, api_keys=["sk-secret"])
    assert (await api.get("/health")).status_code == 200
    assert (await api.get("/ready")).status_code == 200
    assert (await api.get("/v1/models")).status_code == 401


def test_a_database_key_is_shown_once_and_stored_hashed(settings, capsys):
    from models_registry.models import ApiKey

    call_command("createapikey", "team-a", "--admin")
    key = capsys.readouterr().out.strip()
    record = ApiKey.objects.get(label="team-a")
    assert key.startswith("hyp_") and record.admin
    assert key not in (record.key_hash, record.key_prefix) and len(record.key_hash) == 64


async def test_a_database_key_authenticates(api):
    from asgiref.sync import sync_to_async

    from models_registry.models import ApiKey

    _, key = await sync_to_async(ApiKey.create_key)("team-b")
    db_keys_present.invalidate()
    try:
        assert (await post_json(api, URL, CHAT)).status_code == 401
        assert (await post_json(api, URL, CHAT, authorization=f"Bearer {key}")).status_code == 200
    finally:
        await sync_to_async(ApiKey.objects.all().delete)()
        db_keys_present.invalidate()


async def test_without_keys_a_database_outage_leaves_the_server_open(api, monkeypatch):
    """No key in the config, none in the database at its last look: while the database is down
    a request needs no key lookup, so it is served (every call was a 503, issue 35). Once a
    key was seen there, the outage is a 503: the key could not be checked."""
    from asgiref.sync import sync_to_async
    from django.db import OperationalError

    from models_registry.models import ApiKey

    db_keys_present.invalidate()
    assert (await post_json(api, URL, CHAT)).status_code == 200  # the database read: no key

    def down(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OperationalError("connection refused")

    with monkeypatch.context() as outage:
        outage.setattr(ApiKey.objects, "filter", down)
        db_keys_present._checked_at = float("-inf")  # its last look is past its few seconds
        served = await post_json(api, URL, CHAT)
        assert served.status_code == 200, served.content
    await sync_to_async(ApiKey.create_key)("team-c")
    db_keys_present.invalidate()
    try:
        assert (await post_json(api, URL, CHAT)).status_code == 401  # the read: a key now
        with monkeypatch.context() as outage:
            outage.setattr(ApiKey.objects, "filter", down)
            db_keys_present._checked_at = float("-inf")
            # As a server answers it (the test client re-raises what reaches handler500).
            refused = await post_json(AsyncClient(raise_request_exception=False), URL, CHAT)
            assert refused.status_code == 503 and error_of(refused)["code"] == "database_unavailable"
    finally:
        await sync_to_async(ApiKey.objects.all().delete)()
        db_keys_present.invalidate()


async def test_while_staging_inference_is_a_503_with_retry_after(api, settings, use_worker):
    use_worker(Worker(settings.HYPNOS))  # never started: still staging
    response = await post_json(api, URL, CHAT)
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert error_of(response)["type"] == "model_not_available"
    assert "pre-staging" in error_of(response)["message"]
    ready = await api.get("/ready")
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "reason": "startup tier initialization in progress"}
    assert (await api.get("/v1/models")).status_code == 200


async def test_missing_weights_are_a_503_naming_the_file(api, settings, use_worker, tmp_path):
    config: HypnosConfig = settings.HYPNOS
    worker = Worker(
        config.model_copy(update={"server": config.server.model_copy(update={"models_dir": str(tmp_path)})})
    )
    worker._staged.set()
    use_worker(worker)
    response = await post_json(api, URL, CHAT)
    assert response.status_code == 503
    assert str(tmp_path) in error_of(response)["message"]


class FailingAfterOneTokenEngine(Engine):
    """Failure injection (a fake by design): emits one delta, then the engine breaks."""

    loaded = True
    warm_bytes = 0
    context_len = 4096

    def footprint(self) -> Footprint:
        return Footprint(layer_bytes=(1,), other_bytes=0, kv_bytes_per_token=0, workspace_bytes=0)

    def warm(self) -> float:
        return 0.0

    def load(self, context_len: int, gpu_layers: int):  # pragma: no cover - it starts loaded
        raise AssertionError

    def unload(self) -> None:
        pass

    def cool(self) -> None:
        pass

    def chat(self, work, cancel: threading.Event, on_delta) -> ChatResult:
        on_delta("Hel", None)
        raise RuntimeError("decode failed")


def with_engine(worker: Worker, engine: Engine) -> Worker:
    runtime = worker.models["smollm2-135m"]
    runtime.engine = engine
    worker.tiers.register("smollm2-135m", "normal", engine.footprint())
    worker.tiers.book_tier1("smollm2-135m", Placement(primary_tier=MemoryTier.TIER1))
    worker._staged.set()
    return worker


async def test_a_failure_mid_stream_is_an_error_chunk_then_done(api, settings, use_worker):
    worker = Worker(settings.HYPNOS)
    use_worker(with_engine(worker, FailingAfterOneTokenEngine(worker.models["smollm2-135m"].config, None, 1)))
    events = await read_sse(await post_json(api, URL, CHAT | {"stream": True}))
    assert events[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert events[-2]["choices"][0]["finish_reason"] == "error"
    assert events[-2]["error"]["type"] == "server_error"
    assert "decode failed" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"
    assert worker.models["smollm2-135m"].admitted == 0
    failed = await post_json(api, URL, CHAT)
    assert failed.status_code == 500 and error_of(failed)["type"] == "server_error"
