"""The tier manager with two real models under a simulated budget that holds only one of them:
SmolLM2-135M (~250 MB resident at 2k context) and Qwen2.5-Coder-0.5B (~830 MB)."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypnos_site.config import HypnosConfig
from hypnos_site.errors import DeviceOutOfMemory
from inference.engines.llama import LlamaEngine
from inference.worker import Worker
from memory.device import process_memory_bytes
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
URL = "/v1/chat/completions"
ONE_MODEL_BUDGET = 900_000_000
LONG_STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


def tight_config(config: HypnosConfig, **hardware: object) -> HypnosConfig:
    models = [m.model_copy(update={"initial_tier": "tier3_nvme_ssd", "context_len": 2048}) for m in config.models[:2]]
    return config.model_copy(
        update={
            "hardware": config.hardware.model_copy(
                update={"simulated_vram_bytes": ONE_MODEL_BUDGET, "min_gpu_layer_ratio": 1.0, **hardware}
            ),
            "limits": config.limits.model_copy(update={"max_queue_per_model": 24, "max_tokens_cap": 2000}),
            "models": models,
        }
    )


def started(worker: Worker) -> Worker:
    worker.start()
    assert worker.wait_ready(60)
    return worker


@pytest.fixture
def tight(settings, use_worker) -> Iterator[Worker]:
    worker = use_worker(started(Worker(tight_config(settings.HYPNOS))))
    yield worker
    worker.shutdown()


async def chat(api, model: str, **extra: object) -> dict:
    response = await post_json(api, URL, {"model": model, "messages": PARIS_MESSAGES, "max_tokens": 4, **extra})
    assert response.status_code == 200, response.content
    return response.json()


async def memory_status(api) -> dict:
    response = await api.get("/v1/memory/status")
    assert response.status_code == 200
    return response.json()


async def test_alternating_models_are_all_served_and_each_switch_is_reported(api, tight):
    first = (await chat(api, SMOL))["hypnos_telemetry"]
    assert first["previous_tier"] == "tier3_nvme_ssd"
    assert first["tier_switch_phases"]["load_mode"] == "read"
    assert first["evicted_models"] == []

    second = (await chat(api, QWEN))["hypnos_telemetry"]
    assert second["previous_tier"] == "tier3_nvme_ssd"
    assert second["evicted_models"] == [SMOL]

    third = (await chat(api, SMOL))["hypnos_telemetry"]
    assert third["previous_tier"] == "tier2_pinned_ram"  # evicted warm, not to disk
    assert third["tier_switch_phases"]["load_mode"] == "mmap"
    assert third["evicted_models"] == [QWEN]
    assert third["tier_switch_latency_ms"] > 0

    fourth = (await chat(api, SMOL))["hypnos_telemetry"]
    assert fourth["previous_tier"] == "tier1_gpu_vram"
    assert fourth["tier_switch_latency_ms"] == 0.0 and "tier_switch_phases" not in fourth

    status = await memory_status(api)
    evictions = status["recent_evictions"]
    assert [(e["model"], e["for_model"], e["to_tier"]) for e in evictions[:2]] == [
        (QWEN, SMOL, "tier2_pinned_ram"),
        (SMOL, QWEN, "tier2_pinned_ram"),
    ]
    assert all(e["reason"] == "full_gpu_placement" for e in evictions[:2])
    tiers = {m["id"]: m["current_tier"] for m in status["models"]}
    assert tiers == {SMOL: "tier1_gpu_vram", QWEN: "tier2_pinned_ram"}


async def test_twenty_concurrent_requests_load_the_model_once(api, tight):
    responses = await asyncio.gather(
        *[post_json(api, URL, {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 1}) for _ in range(20)]
    )
    assert [r.status_code for r in responses] == [200] * 20
    assert tight.models[SMOL].loads == 1
    switched = [
        r.json()["hypnos_telemetry"] for r in responses if r.json()["hypnos_telemetry"]["tier_switch_latency_ms"]
    ]
    assert len(switched) == 1 and switched[0]["previous_tier"] == "tier3_nvme_ssd"


async def test_a_leased_model_is_never_evicted(api, tight):
    await chat(api, SMOL)
    body = {"model": SMOL, "messages": LONG_STORY, "max_tokens": 400, "stream": True}
    response = await post_json(api, URL, body)
    reader, chunks = read_in_background(response)
    try:
        assert await wait_until(lambda: len(chunks) >= 2, timeout=30)
        refused = await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 1})
        assert refused.status_code == 507
        assert refused.json()["error"]["type"] == "insufficient_vram_or_ram"
        assert tight.tiers.entries[SMOL].tier == "tier1_gpu_vram"
        await reader
    finally:
        reader.cancel()
    assert b"[DONE]" in chunks[-1] and b'"finish_reason": "error"' not in b"".join(chunks)
    # The lease is released before the stream ends: the same request now evicts the idle model.
    assert (await chat(api, QWEN))["hypnos_telemetry"]["evicted_models"] == [SMOL]


async def test_a_partial_placement_serves_next_to_a_leased_model(api, settings, use_worker):
    worker = use_worker(started(Worker(tight_config(settings.HYPNOS, min_gpu_layer_ratio=0.5))))
    try:
        await chat(api, SMOL)
        worker.tiers.lease(SMOL, request=False)  # as if SMOL were serving a long request
        try:
            telemetry = (await chat(api, QWEN))["hypnos_telemetry"]
        finally:
            worker.tiers.release(SMOL, served=False)
        placement = telemetry["placement"]
        assert telemetry["evicted_models"] == []
        assert 12 <= placement["gpu_layers"] < 24 and placement["pinned_ram_layers"] == 24 - placement["gpu_layers"]
        assert placement["pinned_ram_bytes"] > 0
        status = await memory_status(api)
        assert status["tier1_vram_used_bytes"] <= ONE_MODEL_BUDGET
    finally:
        worker.shutdown()


async def test_a_model_that_cannot_fit_alone_is_a_507(api, settings, use_worker):
    worker = use_worker(started(Worker(tight_config(settings.HYPNOS, simulated_vram_bytes=300_000_000))))
    try:
        response = await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES})
        assert response.status_code == 507
        error = response.json()["error"]
        assert error["type"] == "insufficient_vram_or_ram" and QWEN in error["message"]
        assert worker.tiers.entries[QWEN].tier == "tier3_nvme_ssd"
        assert worker.models[QWEN].admitted == 0
        assert (await chat(api, SMOL))["choices"][0]["message"]["content"]
    finally:
        worker.shutdown()


async def test_a_process_memory_cap_is_a_507_naming_it(api, settings, use_worker):
    cap = process_memory_bytes() + 100_000_000  # room for SmolLM2's KV and workspace, not Qwen's
    worker = use_worker(started(Worker(tight_config(settings.HYPNOS, max_process_memory_bytes=cap))))
    try:
        response = await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES})
        assert response.status_code == 507
        assert response.json()["error"]["type"] == "process_memory_cap"
    finally:
        worker.shutdown()


async def test_the_status_byte_counters_add_up(api, tight):
    await chat(api, QWEN)
    await chat(api, SMOL)
    status = await memory_status(api)
    caps = status["capabilities"]
    assert caps["simulated"] is True and caps["usable_vram_budget_bytes"] == ONE_MODEL_BUDGET
    models = {m["id"]: m for m in status["models"]}
    tier1 = sum(
        m["placement"]["vram_weight_bytes"] + m["placement"]["vram_kv_and_workspace_bytes"]
        for m in models.values()
        if m["current_tier"] == "tier1_gpu_vram"
    )
    tier2 = sum(m["placement"]["pinned_ram_bytes"] for m in models.values())
    assert status["tier1_vram_used_bytes"] == tier1 > 0
    assert status["tier1_vram_free_bytes"] == ONE_MODEL_BUDGET - tier1
    assert status["tier1_vram_effective_free_bytes"] == status["tier1_vram_free_bytes"]
    assert status["tier2_pinned_ram_used_bytes"] == tier2 == models[QWEN]["total_weight_bytes"]
    assert (
        status["tier2_pinned_ram_used_bytes"] + status["tier2_pinned_ram_free_bytes"] == caps["pinned_ram_budget_bytes"]
    )
    assert status["process_memory_bytes"] > tier1
    assert models[SMOL]["requests_per_minute"] > 0 and models[SMOL]["total_requests_served"] == 1
    assert models[QWEN]["reload_estimate_ms"] > 0
    assert status["latency"]["routes"]["/v1/chat/completions"]["count"] >= 2


async def test_memory_tier_moves_a_model_by_hand(api, tight):
    moved = await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier2_pinned_ram"})
    assert moved.status_code == 200
    assert moved.json() == {"model": QWEN, "placement": tight.tiers.entries[QWEN].placement.as_dict()}
    assert moved.json()["placement"]["primary_tier"] == "tier2_pinned_ram"
    up = (
        await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier1_gpu_vram", "context_len": 3072})
    ).json()
    assert up["placement"]["primary_tier"] == "tier1_gpu_vram" and up["placement"]["allocated_context_len"] == 3072
    telemetry = (await chat(api, QWEN))["hypnos_telemetry"]
    assert telemetry["previous_tier"] == "tier1_gpu_vram" and telemetry["tier_switch_latency_ms"] == 0.0
    down = (await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier3_nvme_ssd"})).json()
    assert down["placement"]["primary_tier"] == "tier3_nvme_ssd"
    assert (
        await post_json(api, "/v1/memory/tier", {"model": "nope", "target_tier": "tier1_gpu_vram"})
    ).status_code == 404
    bad = await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier9"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "target_tier"


async def test_memory_tier_refuses_a_leased_model(api, tight):
    await chat(api, SMOL)
    tight.tiers.lease(SMOL)
    try:
        response = await post_json(api, "/v1/memory/tier", {"model": SMOL, "target_tier": "tier3_nvme_ssd"})
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "model_busy"
    finally:
        tight.tiers.release(SMOL, served=False)


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache, asked of the kernel with mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        # A private mapping faults nothing in; its untouched pages are the page cache's.
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        anchor = ctypes.c_char.from_buffer(mapped)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor
            mapped.close()
    return sum(v & 1 for v in vec)


async def test_demotion_to_tier3_drops_the_page_cache(api, tight, settings):
    await chat(api, QWEN)
    weights = tight.config.weights_file(tight.config.models[1])
    down = await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier3_nvme_ssd"})
    assert down.status_code == 200
    total = (weights.stat().st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    assert resident_pages(weights) < total // 20
    cold = (await chat(api, QWEN))["hypnos_telemetry"]
    assert cold["previous_tier"] == "tier3_nvme_ssd" and cold["tier_switch_phases"]["load_mode"] == "read"


class OutOfMemoryOnceEngine(LlamaEngine):
    """Failure injection: the real engine, whose first chat fails as a device out of memory."""

    failed = False

    def chat(self, work, cancel: threading.Event, on_delta):  # type: ignore[no-untyped-def]
        if not OutOfMemoryOnceEngine.failed:
            OutOfMemoryOnceEngine.failed = True
            raise DeviceOutOfMemory("simulated allocation failure")
        return super().chat(work, cancel, on_delta)


async def test_a_device_oom_evicts_idle_models_and_retries_once(api, settings, use_worker):
    config = tight_config(settings.HYPNOS, simulated_vram_bytes=4_000_000_000)
    worker = use_worker(started(Worker(config)))
    try:
        await chat(api, QWEN)
        runtime = worker.models[SMOL]
        runtime.engine = OutOfMemoryOnceEngine(runtime.config, config.weights_file(runtime.config), None)
        worker.tiers.register(SMOL, "normal", runtime.engine.footprint())
        body = await chat(api, SMOL)
        assert body["choices"][0]["message"]["content"]
        assert body["hypnos_telemetry"]["evicted_models"] == [QWEN]
        assert worker.tiers.recent_evictions[0]["reason"] == "device_out_of_memory"
    finally:
        worker.shutdown()


def test_no_warm_copy_is_left_open_after_cooling(settings):
    config = tight_config(settings.HYPNOS)
    engine = LlamaEngine(config.models[0], config.weights_file(config.models[0]), None)
    before = len(os.listdir("/proc/self/fd"))
    engine.load(1024, 0)
    engine.cool()
    assert len(os.listdir("/proc/self/fd")) == before
