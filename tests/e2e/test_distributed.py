"""What only the distributed deployment has: a light web process, several web processes,
database keys shared through PostgreSQL, and a bounded wait when no worker runs."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from hypnos_site.config import BASE_DIR
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server, base_env, free_port, migrate, run_manage, start, wait_ready, write_config

pytestmark = pytest.mark.e2e
ENGINE_MODULES = [
    "llama_cpp",
    "inference.engines.llama",
    "onnxruntime",
    "faster_whisper",
    "piper",
    "docling",
    "ncnn",
    "stable_diffusion_cpp",
    "tokenizers",
]


def test_the_web_process_does_not_import_engine_libraries(tmp_path):
    env = base_env(write_config(tmp_path), tmp_path, HYPNOS_DEPLOYMENT="distributed")
    code = (
        "import sys, hypnos_site.asgi, inference.web.openai.views, inference.web.openai.serving_chat\n"
        f"print([m for m in {ENGINE_MODULES!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_second_web_process_with_database_keys_shares_the_worker(distributed: Server, tmp_path):
    env = dict(distributed.env)
    key = run_manage(["createapikey", "e2e-" + uuid.uuid4().hex[:6]], env).strip()
    port = free_port()
    env["HYPNOS_PORT"] = str(port)
    web = start("daphne-second", ["-m", "hypnos_site.serve"], env, tmp_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, web)
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
        assert caught.value.response.headers["www-authenticate"] == 'Bearer realm="hypnos"'
        assert caught.value.body["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="smollm2-135m", messages=PARIS_MESSAGES, temperature=0)
        assert "Paris" in answer.choices[0].message.content
    finally:
        web.stop()
        run_manage(["shell", "-c", "from models_registry.models import ApiKey; ApiKey.objects.all().delete()"], env)


def test_without_a_worker_requests_get_a_503_in_bounded_time(tmp_path, redis_url, postgres_url):
    port = free_port()
    env = base_env(
        write_config(tmp_path, ack_timeout_secs=1.0),
        tmp_path,
        HYPNOS_DEPLOYMENT="distributed",
        HYPNOS_DATABASE_URL=postgres_url,
        HYPNOS_REDIS_URL=redis_url,
        HYPNOS_CHANNEL_PREFIX="hypnos-noworker-" + uuid.uuid4().hex[:8],
        HYPNOS_PORT=str(port),
    )
    # Its own migration: the session's database is not migrated before the first server that
    # needs it (this test once passed only because the shared deployment had run before it).
    migrate(env)
    web = start("daphne-alone", ["-m", "hypnos_site.serve"], env, tmp_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{base_url}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        ready = httpx.get(f"{base_url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        started = time.monotonic()
        response = httpx.post(
            f"{base_url}/v1/chat/completions", timeout=30, json={"model": "smollm2-135m", "messages": PARIS_MESSAGES}
        )
        # One ack timeout (1 s here; 1.05 s measured idle), not a hang (the client's 30 s).
        assert time.monotonic() - started < 10
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "model_not_available"
        assert "runinference" in response.json()["error"]["message"]
    finally:
        web.stop()


def test_memory_status_and_tier_moves_cross_the_channel_layer(distributed: Server):
    base = distributed.base_url
    status = httpx.get(f"{base}/v1/memory/status", timeout=30).json()
    assert status["capabilities"]["simulated"] is True
    model = status["models"][0]
    assert model["id"] == "smollm2-135m" and model["current_tier"] == "tier1_gpu_vram"
    assert status["models"][1]["current_tier"] == "tier3_nvme_ssd"
    # The session's server may hold other models in tier 1 by now (the audio and embedding tests).
    resident = [m["placement"] for m in status["models"] if m["current_tier"] == "tier1_gpu_vram"]
    assert status["tier1_vram_used_bytes"] == sum(
        p["vram_weight_bytes"] + p["vram_kv_and_workspace_bytes"] for p in resident
    )
    moved = httpx.post(
        f"{base}/v1/memory/tier", json={"model": "smollm2-135m", "target_tier": "tier2_pinned_ram"}, timeout=60
    )
    assert moved.status_code == 200 and moved.json()["placement"]["primary_tier"] == "tier2_pinned_ram"
    answer = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=60,
        json={"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2},
    ).json()
    telemetry = answer["hypnos_telemetry"]
    assert telemetry["previous_tier"] == "tier2_pinned_ram"
    assert telemetry["tier_switch_phases"]["load_mode"] == "mmap"
    assert (
        httpx.post(
            f"{base}/v1/memory/tier", json={"model": "nope", "target_tier": "tier1_gpu_vram"}, timeout=30
        ).status_code
        == 404
    )
