"""Admission beyond the queue bound: estimated waits, deadlines, next-model prefetch, workflows."""

from __future__ import annotations

import asyncio

import pytest

from inference.transport.deadline import within
from inference.worker import Worker
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
LONG_STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


async def test_an_admitted_request_carries_its_estimated_wait(api):
    response = await post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2})
    assert response.status_code == 200
    assert response["x-hypnos-estimated-wait-ms"] == "0"


async def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(api, worker, settings):
    with_limits(settings, max_tokens_cap=2000)
    await post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 8})
    assert worker.models[SMOL].service_ms is not None
    busy = await post_json(api, URL, {"model": SMOL, "messages": LONG_STORY, "max_tokens": 2000, "stream": True})
    reader = asyncio.create_task(_drain(busy))
    try:
        refused = await post_json(
            api, URL, {"model": SMOL, "messages": PARIS_MESSAGES}, **{"x-hypnos-deadline-ms": "1"}
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "deadline_unmeetable"
        assert int(refused["Retry-After"]) >= 1
        assert worker.models[SMOL].admitted == 1  # the refused request was never queued
        bad = await post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES}, **{"x-hypnos-deadline-ms": "soon"})
        assert bad.status_code == 400
    finally:
        reader.cancel()
    assert await wait_until(lambda: worker.models[SMOL].admitted == 0, timeout=30)
    status = (await api.get("/v1/memory/status")).json()
    smol = next(m for m in status["models"] if m["id"] == SMOL)
    assert smol["service_ms"] > 0 and smol["estimated_wait_ms"] == 0


async def _drain(response) -> None:  # type: ignore[no-untyped-def]
    async for _ in response.streaming_content:
        pass


async def test_the_next_model_is_loaded_while_this_request_runs(api, settings, use_worker):
    config = settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:2]})
    worker = use_worker(Worker(config))
    worker.start()
    assert worker.wait_ready(60)
    try:
        assert worker.tiers.entries[QWEN].tier == "tier3_nvme_ssd"
        response = await post_json(
            api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2}, **{"x-hypnos-next-model": QWEN}
        )
        assert response.status_code == 200
        assert await wait_until(lambda: worker.tiers.entries[QWEN].tier == "tier1_gpu_vram", timeout=60)
        telemetry = (await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 2})).json()
        assert telemetry["hypnos_telemetry"]["previous_tier"] == "tier1_gpu_vram"
        unknown = await post_json(
            api,
            URL,
            {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2},
            **{"x-hypnos-next-model": "no-such-model"},
        )
        assert unknown.status_code == 200
    finally:
        worker.shutdown()


async def test_a_workflow_is_timed_from_its_first_start_to_its_last_byte(api):
    headers = {"x-hypnos-workflow": "voice_turn/turn-1"}
    first = await post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2}, **headers)
    second = await post_json(
        api,
        URL,
        {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2, "stream": True},
        **headers,
        **{"x-hypnos-workflow-end": "true"},
    )
    await _drain(second)
    assert first.status_code == second.status_code == 200
    workflows = (await api.get("/v1/memory/status")).json()["latency"]["workflows"]
    assert workflows["voice_turn"]["count"] == 1
    assert workflows["voice_turn"]["p50_ms"] > 0


async def test_a_shedding_profile_refuses_what_its_objective_cannot_meet(api, settings, use_worker):
    from hypnos_site.config import ProfileConfig

    profile = ProfileConfig.model_validate(
        {"name": "voice_assistant", "objective": {"metric": "first_token", "target_ms": 1}}
    )
    config = settings.HYPNOS.model_copy(
        update={
            "models": settings.HYPNOS.models[:2],
            "server": settings.HYPNOS.server.model_copy(update={"profile": profile}),
            "limits": settings.HYPNOS.limits.model_copy(update={"overload": "shed"}),
        }
    )
    worker = use_worker(Worker(config))
    worker.start()
    assert worker.wait_ready(60)
    try:
        # SmolLM2 is resident (no wait); Qwen would need a load, beyond the 1 ms objective.
        assert (
            await post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 1})
        ).status_code == 200
        shed = await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 1})
        assert shed.status_code == 503 and shed.json()["error"]["type"] == "deadline_unmeetable"
        status = (await api.get("/v1/memory/status")).json()
        assert status["profile"] == {
            "name": "voice_assistant",
            "objective": {"metric": "first_token", "target_ms": 1.0},
        }
    finally:
        worker.shutdown()


async def test_a_background_request_takes_a_slot_only_while_no_interactive_one_waits(api, worker):
    """x-hypnos-priority: background (a batch's lines): with every slot of the model taken, a
    background request and then an interactive one wait; the slot freed goes to the interactive
    one, though it came second."""
    embed = "all-minilm-l6-v2"
    warm = await post_json(api, "/v1/embeddings", {"model": embed, "input": "warm up"})
    assert warm.status_code == 200
    runtime = worker.models[embed]
    held = 0
    while runtime.slots.acquire(blocking=False):
        held += 1
    finished: list[str] = []

    async def call(name: str, **headers: str) -> None:
        response = await post_json(api, "/v1/embeddings", {"model": embed, "input": name}, **headers)
        assert response.status_code == 200, response.content
        finished.append(name)

    try:
        background = asyncio.create_task(call("background", **{"x-hypnos-priority": "background"}))
        assert await wait_until(lambda: runtime.admitted == 1, 30)
        assert runtime.background_running == 0  # waiting, not holding a slot
        interactive = asyncio.create_task(call("interactive"))
        assert await wait_until(lambda: runtime.interactive_waiting == 1, 30)
        runtime.slots.release()  # one slot: the interactive request's, though it came second
        held -= 1
        await within(asyncio.gather(background, interactive), 120)
    finally:
        for _ in range(held):
            runtime.slots.release()
    assert finished == ["interactive", "background"]
    status = (await api.get("/v1/memory/status")).json()
    assert next(m for m in status["models"] if m["id"] == embed)["background_requests"] == 0


async def test_an_unknown_priority_is_a_400(api):
    body = {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2}
    response = await post_json(api, URL, body, **{"x-hypnos-priority": "urgent"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-hypnos-priority"


async def test_the_memory_status_shows_the_background_requests_holding_a_slot(api, worker):
    body = {"model": SMOL, "messages": LONG_STORY, "max_tokens": 400, "stream": True}
    response = await post_json(api, URL, body, **{"x-hypnos-priority": "background"})
    assert response.status_code == 200
    task, chunks = read_in_background(response)
    try:
        assert await wait_until(lambda: len(chunks) > 2, 60)
        status = (await api.get("/v1/memory/status")).json()
        assert next(m for m in status["models"] if m["id"] == SMOL)["background_requests"] == 1
    finally:
        task.cancel()
    assert await wait_until(lambda: worker.models[SMOL].background_running == 0, 30)
