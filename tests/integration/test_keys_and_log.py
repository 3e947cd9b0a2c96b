"""Keys, per-key limits, the request log and /metrics through the views, the in-process worker
and real SmolLM2 (the embedded deployment: the counters live in this process's memory)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import hypnos_site.metrics as metrics_module
import models_registry.quotas as quotas_module
from hypnos_site.config import KeyConfig
from logs.store import levels
from models_registry.quotas import secs_to_midnight
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, read_sse, wait_until, with_server

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2}
ADMIN = "sk-admin-test"


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no quota usage, no counted metrics and the configured log level."""
    monkeypatch.setattr(quotas_module, "_memory_quotas", quotas_module.MemoryQuotas())
    monkeypatch.setattr(metrics_module, "_memory_counters", metrics_module.MemoryCounters())
    levels.reset()
    yield
    levels.reset()


def with_keys(settings: Any, *keys: KeyConfig, **server: Any) -> None:
    with_server(settings, api_keys=[ADMIN], keys=list(keys), **server)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def log_records(api: Any, query: str = "", key: str = ADMIN) -> dict[str, Any]:
    response = await api.get(f"/v1/logs{query}", headers=bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


async def logged(api: Any, count: int, timeout: float = 30.0) -> dict[str, Any]:
    """The log once it holds `count` records (a call the client dropped is logged just after)."""
    deadline = time.monotonic() + timeout
    while (log := await log_records(api))["stored"] < count and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return log


async def scrape(api: Any, **headers: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET /metrics parsed with prometheus_client's parser: sample name -> labels -> value."""
    response = await api.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


# -- limits ------------------------------------------------------------------------------------


async def test_it_refuses_the_call_past_requests_per_minute_with_retry_after(api, settings):
    with_keys(settings, KeyConfig(key="sk-rpm", label="rpm", requests_per_minute=2))
    statuses = [(await post_json(api, URL, CHAT, **bearer("sk-rpm"))) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    refused = statuses[-1]
    assert error_of(refused) | {"message": ""} == {
        "message": "",
        "type": "rate_limit_error",
        "param": None,
        "code": "requests_per_minute",
    }
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused["x-request-id"].startswith("req-")
    # Another key has its own window.
    assert (await post_json(api, URL, CHAT, **bearer(ADMIN))).status_code == 200


async def test_it_holds_the_concurrency_permit_until_the_stream_ends(api, settings):
    with_keys(settings, KeyConfig(key="sk-one", label="one-at-a-time", max_concurrent=1))
    stream = await post_json(api, URL, CHAT | {"stream": True, "max_tokens": 4}, **bearer("sk-one"))
    assert stream.status_code == 200
    refused = await post_json(api, URL, CHAT, **bearer("sk-one"))
    assert refused.status_code == 429
    assert error_of(refused)["code"] == "max_concurrent" and refused["Retry-After"] == "1"
    events = await read_sse(stream)
    assert events[-1] == "[DONE]"
    assert (await post_json(api, URL, CHAT, **bearer("sk-one"))).status_code == 200


async def test_a_stream_the_client_drops_gives_its_permit_back_and_is_logged(api, settings):
    with_keys(settings, KeyConfig(key="sk-one", label="one-at-a-time", max_concurrent=1))
    stream = await post_json(api, URL, CHAT | {"stream": True, "max_tokens": 60}, **bearer("sk-one"))
    # Django's ASGI handler cancels the response task when the client disconnects; so does this.
    reader, chunks = read_in_background(stream)
    try:
        assert await wait_until(lambda: len(chunks) >= 3, timeout=60)
    finally:
        reader.cancel()
    assert await wait_until(lambda: quotas_module._memory_quotas._inflight["one-at-a-time"] == {}, timeout=15)
    dropped = (await logged(api, 1))["records"][0]
    assert dropped["id"] == stream["x-request-id"] and dropped["stream"] is True
    assert dropped["error"] == "the client disconnected before the response was complete"
    # What it generated up to the disconnect, and why it ended (test_hardening_auth has the counts).
    assert dropped["tokens_out"] >= 2 and dropped["finish_reason"] == "cancelled"
    assert dropped["level"] == "warn" and dropped["status"] == 200
    assert (await post_json(api, URL, CHAT, **bearer("sk-one"))).status_code == 200


async def test_a_call_the_client_abandons_frees_its_permit_and_is_logged_as_499(api, settings):
    with_keys(settings, KeyConfig(key="sk-one", label="one-at-a-time", max_concurrent=1))
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    call = asyncio.create_task(post_json(api, URL, CHAT | {"messages": story, "max_tokens": 60}, **bearer("sk-one")))
    assert await wait_until(lambda: quotas_module._memory_quotas._inflight["one-at-a-time"] != {}, timeout=10)
    # At once: 60 tokens of a cached prompt can be done within a fraction of a second.
    call.cancel()
    assert await wait_until(lambda: quotas_module._memory_quotas._inflight["one-at-a-time"] == {}, timeout=15)
    [record] = (await logged(api, 1))["records"]
    assert (record["status"], record["key"], record["level"]) == (499, "one-at-a-time", "warn")
    assert record["error"] == "the client disconnected before the response was complete"
    assert (record["finish_reason"], record["tokens_out"]) == ("cancelled", None)


async def test_tokens_per_day_reached_is_a_429_until_midnight_utc(api, settings):
    with_keys(settings, KeyConfig(key="sk-tpd", label="daily", tokens_per_day=5))
    first = await post_json(api, URL, CHAT, **bearer("sk-tpd"))
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 5
    refused = await post_json(api, URL, CHAT, **bearer("sk-tpd"))
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "tokens_per_day" and error["type"] == "rate_limit_error"
    assert abs(int(refused["Retry-After"]) - secs_to_midnight(time.time())) <= 5


async def test_a_stream_is_charged_when_it_ends(api, settings):
    with_keys(settings, KeyConfig(key="sk-tpd", label="daily", tokens_per_day=1))
    stream = await post_json(api, URL, CHAT | {"stream": True}, **bearer("sk-tpd"))
    # Not charged yet: the stream has not ended, so a second call still passes the check.
    assert (await post_json(api, URL, CHAT, **bearer("sk-tpd"))).status_code == 200
    events = await read_sse(stream)
    usage = events[-2]["usage"]
    samples = await scrape(api, **bearer(ADMIN))
    assert samples["hypnos_api_key_tokens_today"][(("key", "daily"),)] > usage["total_tokens"]
    assert (await post_json(api, URL, CHAT, **bearer("sk-tpd"))).status_code == 429


async def test_a_key_restricted_to_models_gets_403_for_the_others(api, settings):
    with_keys(
        settings,
        KeyConfig(key="sk-coder", label="coder", models=["qwen2.5-coder-0.5b"]),
        KeyConfig(key="sk-mini", label="mini", models=["gpt-4o-mini"]),
    )
    refused = await post_json(api, URL, CHAT, **bearer("sk-coder"))
    assert refused.status_code == 403
    assert error_of(refused) | {"message": ""} == {
        "message": "",
        "type": "permission_denied",
        "param": "model",
        "code": "model_not_allowed",
    }
    # An alias in the list allows the model it names, under either name.
    assert (await post_json(api, URL, CHAT, **bearer("sk-mini"))).status_code == 200
    assert (await post_json(api, URL, CHAT | {"model": "gpt-4o-mini"}, **bearer("sk-mini"))).status_code == 200


async def test_the_model_of_a_multipart_call_is_checked_too(api, settings):
    from django.core.files.uploadedfile import SimpleUploadedFile

    with_keys(settings, KeyConfig(key="sk-chat", label="chat-only", models=["smollm2-135m"]))
    form = {"model": "an-stt-model", "file": SimpleUploadedFile("a.wav", b"RIFF....WAVE", "audio/wav")}
    refused = await api.post("/v1/audio/transcriptions", form, headers=bearer("sk-chat"))
    assert refused.status_code == 403 and error_of(refused)["code"] == "model_not_allowed"
    [record] = (await log_records(api))["records"]
    assert (record["route"], record["model"], record["key"]) == (
        "/v1/audio/transcriptions",
        "an-stt-model",
        "chat-only",
    )


async def test_a_database_key_carries_its_limits_and_models(api, settings):
    from asgiref.sync import sync_to_async

    from models_registry.authentication import db_keys_present
    from models_registry.models import ApiKey

    _, key = await sync_to_async(ApiKey.create_key)("db-limited", requests_per_minute=1, allowed_models="smollm2-135m")
    db_keys_present.invalidate()
    try:
        assert (await post_json(api, URL, CHAT | {"model": "qwen2.5-coder-0.5b"}, **bearer(key))).status_code == 403
        assert (await post_json(api, URL, CHAT, **bearer(key))).status_code == 200
        refused = await post_json(api, URL, CHAT, **bearer(key))
        assert refused.status_code == 429 and error_of(refused)["code"] == "requests_per_minute"
        assert [r["key"] for r in (await log_records(api, "?key=db-limited", key))["records"]] == ["db-limited"] * 3
    finally:
        await sync_to_async(ApiKey.objects.all().delete)()
        db_keys_present.invalidate()


# -- the request log -------------------------------------------------------------------------------


async def test_every_call_is_logged_once_with_its_status_and_tokens(api, settings):
    with_keys(settings, KeyConfig(key="sk-team", label="team", requests_per_minute=3))
    made = []
    for body in [CHAT, CHAT | {"stream": True}, CHAT | {"model": "nope"}, CHAT | {"temperature": "hot"}, CHAT]:
        response = await post_json(api, URL, body, **bearer("sk-team"))
        usage = (await read_sse(response))[-2]["usage"] if body.get("stream") else response.json().get("usage")
        made.append((response["x-request-id"], response.status_code, usage))
    unauthenticated = await post_json(api, URL, CHAT)
    log = await log_records(api)
    assert log["level"] == "info" and log["capacity"] == 200 and log["stored"] == 6
    by_id = {r["id"]: r for r in log["records"]}
    assert len(by_id) == 6
    assert (
        by_id[unauthenticated["x-request-id"]]["status"] == 401
        and by_id[unauthenticated["x-request-id"]]["key"] is None
    )
    for request_id, status, usage in made:
        record = by_id[request_id]
        assert record["status"] == status and record["key"] == "team"
        assert record["route"] == "/v1/chat/completions" and record["method"] == "POST"
        if usage:
            assert (record["tokens_in"], record["tokens_out"]) == (usage["prompt_tokens"], usage["completion_tokens"])
            assert record["inference_ms"] > 0 and record["previous_tier"] == "tier1_gpu_vram"
        else:
            assert record["tokens_in"] is None and record["error"]
    assert [by_id[i]["stream"] for i, _, _ in made] == [False, True, False, False, False]
    assert [by_id[i]["level"] for i, _, _ in made] == ["info", "info", "warn", "warn", "warn"]
    assert by_id[made[-1][0]]["error"].startswith("The key 'team' made 3 requests")
    assert "sk-team" not in json.dumps(log) and "input" not in by_id[made[0][0]]


async def test_polling_the_log_is_not_logged(api):
    await post_json(api, URL, CHAT)
    for _ in range(3):
        await api.get("/v1/logs")
    await api.get("/metrics")
    assert (await log_records(api))["stored"] == 1


async def test_one_record_is_read_by_its_request_id(api):
    response = await post_json(api, URL, CHAT)
    request_id = response["x-request-id"]
    record = await api.get(f"/v1/logs/{request_id}")
    assert record.status_code == 200 and record.json()["id"] == request_id
    assert record.json()["started_at"].endswith("Z")
    missing = await api.get("/api/v1/logs/req-" + "0" * 32)
    assert missing.status_code == 404 and error_of(missing)["type"] == "not_found"


async def test_the_log_is_cleared_by_delete(api):
    await post_json(api, URL, CHAT)
    assert (await api.delete("/v1/logs")).json() == {"cleared": True}
    assert (await log_records(api))["records"] == []


async def test_the_ring_buffer_keeps_the_newest_entries(api, settings):
    with_server(settings, request_log_capacity=3)
    ids = [(await post_json(api, URL, CHAT | {"model": "nope"}))["x-request-id"] for _ in range(5)]
    log = await log_records(api)
    assert log["stored"] == 3 and log["capacity"] == 3
    assert [r["id"] for r in log["records"]] == ids[:1:-1]


async def test_the_filters_select_records(api, settings):
    with_keys(settings, KeyConfig(key="sk-a", label="a"), KeyConfig(key="sk-b", label="b"))
    ok = (await post_json(api, URL, CHAT, **bearer("sk-a")))["x-request-id"]
    alias = (await post_json(api, URL, CHAT | {"model": "gpt-4o-mini"}, **bearer("sk-b")))["x-request-id"]
    missing = (await post_json(api, URL, CHAT | {"model": "nope"}, **bearer("sk-b")))["x-request-id"]
    ids = lambda log: [r["id"] for r in log["records"]]  # noqa: E731
    assert ids(await log_records(api, "?key=a")) == [ok]
    assert ids(await log_records(api, "?model=smollm2-135m")) == [alias, ok]
    assert ids(await log_records(api, "?status=ok")) == [alias, ok]
    assert ids(await log_records(api, "?status=error")) == ids(await log_records(api, "?status=4xx")) == [missing]
    assert ids(await log_records(api, "?status=404")) == [missing]
    assert ids(await log_records(api, "?status=5xx")) == []
    assert ids(await log_records(api, "?route=chat/completions&limit=1")) == [missing]
    bad = await api.get("/v1/logs?status=meh", headers=bearer(ADMIN))
    assert bad.status_code == 400 and error_of(bad)["param"] == "status"


async def test_debug_captures_the_text_and_trace_the_payloads(api):
    assert (await post_json(api, "/v1/logs/level", {"level": "debug"})).json() == {"level": "debug"}
    answer = (await post_json(api, URL, CHAT | {"temperature": 0})).json()["choices"][0]["message"]["content"]
    [record] = (await log_records(api))["records"]
    assert "user: What is the capital of France?" in record["input"]
    assert record["output"] == answer and "request_payload" not in record
    await post_json(api, "/v1/logs/level", {"level": "trace"})
    events = await read_sse(await post_json(api, URL, CHAT | {"stream": True, "temperature": 0}))
    record = (await log_records(api, "?limit=1"))["records"][0]
    assert json.loads(record["request_payload"])["stream"] is True
    assert record["response_payload"].endswith("data: [DONE]\n\n")
    assert record["output"] == "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert record["truncated"] is False


async def test_redaction_masks_or_blanks_the_captured_text(api, settings):
    await post_json(api, "/v1/logs/level", {"level": "debug"})
    with_server(settings, request_log_redact=r"France|Paris")
    await post_json(api, URL, CHAT)
    record = (await log_records(api, "?limit=1"))["records"][0]
    assert "France" not in record["input"] and "capital of [redacted]?" in record["input"]
    with_server(settings, request_log_redact="blank")
    await post_json(api, URL, CHAT)
    record = (await log_records(api, "?limit=1"))["records"][0]
    assert record["input"] == "" and record["output"] == ""


async def test_the_level_decides_which_calls_are_kept(api):
    await post_json(api, "/v1/logs/level", {"level": "off"})
    await post_json(api, URL, CHAT)
    assert (await log_records(api))["stored"] == 0
    await post_json(api, "/v1/logs/level", {"level": "error"})
    await post_json(api, URL, CHAT | {"model": "nope"})
    assert (await log_records(api))["stored"] == 0
    await post_json(api, "/v1/logs/level", {"level": "warn"})
    await post_json(api, URL, CHAT | {"model": "nope"})
    await post_json(api, URL, CHAT)
    assert [r["status"] for r in (await log_records(api))["records"]] == [404]
    bad = await post_json(api, "/v1/logs/level", {"level": "loud"})
    assert bad.status_code == 400 and error_of(bad)["param"] == "level"


# -- metrics ---------------------------------------------------------------------------------------


async def test_the_http_families_label_each_route_as_the_url_table_names_it(api):
    """Issue 34 item 3: Ollama's /api/tags was '/tags', Lemonade's /api/v1/health '/v1/health' (a
    route that does not exist) and an unknown path '/v1/.*$'; every unknown path is one label."""
    for path in ("/api/tags", "/api/v1/health", "/v1/models/smollm2-135m", "/v1/nope", "/api/nope", "/nothing"):
        await api.get(path)
    samples = await scrape(api)
    routes = {dict(labels)["route"] for labels in samples["hypnos_http_requests_total"]}
    assert {"/api/tags", "/api/v1/health", "/v1/models/<path:model_id>", "unmatched"} <= routes
    assert not routes & {"/tags", "/v1/health", "/v1/.*$", "/.*$"}
    assert not [r for r in routes if r != "unmatched" and any(c in r for c in "^$*")]
    latency = (await api.get("/v1/memory/status")).json()["latency"]["routes"]
    assert "/api/tags" in latency and "/tags" not in latency and not [r for r in latency if "*" in r]


async def test_the_metrics_count_the_calls_of_each_key(api, settings):
    with_keys(settings, KeyConfig(key="sk-m", label="metered", requests_per_minute=2))
    usages = []
    for _ in range(3):
        response = await post_json(api, URL, CHAT, **bearer("sk-m"))
        if response.status_code == 200:
            usages.append(response.json()["usage"]["total_tokens"])
    # The hypnos_api_key_* families name every key: an admin key's scrape shows them.
    samples = await scrape(api, **bearer(ADMIN))
    key = (("key", "metered"),)
    assert samples["hypnos_api_key_requests_total"][key] == 3
    assert samples["hypnos_api_key_rejections_total"][key] == 1
    assert samples["hypnos_api_key_tokens_total"][key] == sum(usages)
    assert samples["hypnos_api_key_tokens_today"][key] == sum(usages)
    route = (("class", "2xx"), ("route", "/v1/chat/completions"))
    assert samples["hypnos_http_requests_total"][route] == 2
    assert samples["hypnos_http_requests_total"][(("class", "4xx"), ("route", "/v1/chat/completions"))] == 1
    assert samples["hypnos_http_request_latency_ms_count"][(("route", "/v1/chat/completions"),)] == 3
    assert samples["hypnos_chat_ttft_ms_count"][(("model", "smollm2-135m"),)] == 2
    model = (("model", "smollm2-135m"),)
    assert samples["hypnos_model_tier"][model] == 1
    assert samples["hypnos_model_active_leases"][model] == 0
    assert samples["hypnos_model_requests_total"][model] >= 2
    assert samples["hypnos_worker_up"][()] == 1
    assert samples["hypnos_vram_bytes"][(("kind", "used"),)] > 0
    assert any(name.startswith("django_http_requests_total_by_view_transport_method") for name in samples)


async def test_metrics_need_a_key_when_the_operator_says_so(api, settings):
    with_keys(settings, metrics_require_auth=True)
    refused = await api.get("/metrics")
    assert refused.status_code == 401 and error_of(refused)["code"] == "invalid_api_key"
    assert (await api.get("/metrics", headers=bearer(ADMIN))).status_code == 200
    with_server(settings, metrics_require_auth=False)
    assert (await api.get("/metrics")).status_code == 200
