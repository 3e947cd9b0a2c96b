"""Lemonade's fields on its routes (issue 17 item 4): /api/v1/health's max_models and per-model
is_busy / is_streaming / recipe_options / pid / telemetry, /api/v1/stats from the first
request on, ctx_size and resolved_ctx_size in the model options, load with save_options,
hardware.max_resident_models, speech's stream_format and language. Real SmolLM2 and Piper."""

from __future__ import annotations

import base64
import json
import os

import pytest

from inference.worker import Worker
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
QWEN = "qwen2.5-coder-0.5b"
TTS = "piper-joe"
HEALTH = "/api/v1/health"


@pytest.fixture
def pool(settings, serve) -> Worker:
    """A server of its own with SmolLM2 alone (its options change and reload it)."""
    settings.HYPNOS = settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:1]})
    return serve(settings.HYPNOS)


def loaded(health: dict, model: str) -> dict:
    return next(m for m in health["all_models_loaded"] if m["model_name"] == model)


async def test_health_lists_the_caps_and_each_loaded_models_state(api, worker):
    await post_json(api, "/v1/chat/completions", {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 1})
    health = (await api.get(HEALTH)).json()
    assert {"llm", "embedding", "reranking", "audio"} <= set(health["max_models"])
    assert health["max_models"]["llm"] >= 1 and health["max_models"]["reranking"] == 0
    smol = loaded(health, SMOL)
    assert smol["type"] == "llm" and smol["recipe"] == "llamacpp"
    assert smol["pid"] == os.getpid()  # the embedded worker runs in this process
    assert smol["recipe_options"]["ctx_size"] == worker.models[SMOL].engine.context_len
    assert smol["telemetry"]["current_tier"] == "tier1_gpu_vram"
    assert smol["telemetry"]["gpu_layers"] == worker.tiers.placement(SMOL).gpu_layers


async def test_a_stream_in_flight_shows_the_model_busy_and_streaming(api, worker):
    assert await wait_until(lambda: worker.models[SMOL].admitted == 0, timeout=30)
    idle = loaded((await api.get(HEALTH)).json(), SMOL)
    assert idle["is_busy"] is False and idle["is_streaming"] is False
    story = {"model": SMOL, "messages": [{"role": "user", "content": "Write a long story."}], "stream": True}
    response = await post_json(api, "/v1/chat/completions", story | {"max_tokens": 400})
    reader, chunks = read_in_background(response)
    try:
        assert await wait_until(lambda: len(chunks) >= 3, timeout=60)
        busy = loaded((await api.get(HEALTH)).json(), SMOL)
        assert busy["is_busy"] is True and busy["is_streaming"] is True
    finally:
        reader.cancel()
    assert await wait_until(lambda: worker.models[SMOL].admitted == 0, timeout=30)


async def test_stats_answer_from_the_start_and_count_cached_tokens(api):
    stats = await api.get("/api/v1/stats")
    assert stats.status_code == 200
    before = stats.json()
    assert {"input_tokens", "output_tokens", "time_to_first_token", "tokens_per_second", "cache_tokens"} <= set(before)
    request = {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        await post_json(api, "/api/v1/chat/completions", request)
    after = (await api.get("/api/v1/stats")).json()
    assert after["output_tokens"] == 2 and after["cache_tokens"] > 0
    assert after["cache_tokens_total"] >= before["cache_tokens_total"] + after["cache_tokens"]


async def test_ctx_size_is_context_len_and_the_options_say_the_resolved_size(api, pool):
    url = f"/v1/models/{SMOL}/options"
    layers = (await api.get(url)).json()
    assert layers["resolved_ctx_size"] == layers["effective"]["context_len"]
    # Nothing saved yet: the model's page still says the context it loads with.
    described = (await api.get(f"/api/v1/models/{SMOL}")).json()
    assert described["recipe_options"] == {"ctx_size": layers["effective"]["context_len"]}
    dry = (await post_json(api, url, {"ctx_size": 3072, "dry_run": True})).json()
    # Answered in both names: Lemonade's clients read ctx_size.
    assert dry["saved"] == {"context_len": 3072, "ctx_size": 3072} and dry["resolved_ctx_size"] == 3072
    assert dry["effective"]["ctx_size"] == dry["effective"]["context_len"] == 3072
    auto = (await post_json(api, url, {"ctx_size": -1, "dry_run": True})).json()
    assert auto["saved"] == {} and auto["resolved_ctx_size"] == layers["effective"]["context_len"]
    both = await post_json(api, url, {"ctx_size": 3072, "context_len": 2048})
    assert both.status_code == 400 and "disagree" in both.json()["error"]["message"]


async def test_options_take_a_context_as_an_integer_within_what_the_model_was_trained_for(api, pool):
    url = f"/v1/models/{SMOL}/options"
    trained = pool.models[SMOL].engine.trained_context_len
    assert trained == 8192  # SmolLM2-135M's GGUF
    for bad in (
        {"ctx_size": "2048"},
        {"context_len": "2048"},
        {"ctx_size": 18446744073709551615},
        {"context_len": trained + 1},
        {"context_len": 100},
        {"slots": "2"},
        {"temperature": "0.5"},
    ):
        refused = await post_json(api, url, bad | {"dry_run": True})
        assert refused.status_code == 400, (bad, refused.content)
    assert "trained for" in (await post_json(api, url, {"context_len": trained + 1})).json()["error"]["message"]
    assert (await api.get(url)).json()["saved"] == {}
    # Lemonade's clients echo the model's name in the body: the path's model is taken, another refused.
    echo = await post_json(api, url, {"model_name": SMOL, "ctx_size": trained, "dry_run": True})
    assert echo.status_code == 200 and echo.json()["saved"]["context_len"] == trained
    other = await post_json(api, url, {"model_name": QWEN, "ctx_size": 2048, "dry_run": True})
    assert other.status_code == 400 and other.json()["error"]["param"] == "model_name"
    sampled = await post_json(api, url, {"temperature": 1, "dry_run": True})
    assert sampled.status_code == 200 and sampled.json()["saved"] == {"temperature": 1.0}


async def test_load_applies_the_context_asked_smaller_or_larger_than_the_configured_one(api, pool):
    configured = pool.models[SMOL].config.context_len
    assert configured == 2048  # tests/hypnos.test.toml
    engine = pool.models[SMOL].engine
    for asked in (1024, 8192, 1024):
        load = await post_json(api, "/api/v1/load", {"model_name": SMOL, "ctx_size": asked})
        assert load.status_code == 200, load.content
        assert engine.context_len == asked
        assert loaded((await api.get(HEALTH)).json(), SMOL)["recipe_options"]["ctx_size"] == asked
    # After an unload the asked context is applied again, not the configured one.
    assert (await post_json(api, "/api/v1/unload", {"model_name": SMOL})).status_code == 200
    assert (await post_json(api, "/api/v1/load", {"model_name": SMOL, "ctx_size": 1024})).status_code == 200
    assert engine.context_len == 1024
    # Without ctx_size: the model's own; beyond what it was trained for: refused, nothing changed.
    assert (await post_json(api, "/api/v1/load", {"model_name": SMOL, "ctx_size": -1})).status_code == 200
    assert engine.context_len == configured
    beyond = await post_json(api, "/api/v1/load", {"model_name": SMOL, "ctx_size": 16384})
    assert beyond.status_code == 400 and "trained for" in beyond.json()["error"]["message"], beyond.content
    assert engine.context_len == configured


async def test_load_with_save_options_keeps_the_context_for_later_loads(api, pool):
    load = {"model_name": SMOL, "ctx_size": 3072, "save_options": True}
    assert (await post_json(api, "/api/v1/load", load)).json()["status"] == "success"
    model = (await api.get(f"/api/v1/models/{SMOL}")).json()
    assert model["recipe_options"]["ctx_size"] == 3072 and model["recipe_options"]["context_len"] == 3072
    assert pool.models[SMOL].config.context_len == 3072
    assert (await post_json(api, "/api/v1/unload", {"model_name": SMOL})).status_code == 200
    assert (await post_json(api, "/api/v1/load", {"model_name": SMOL})).status_code == 200
    assert loaded((await api.get(HEALTH)).json(), SMOL)["recipe_options"]["ctx_size"] == 3072
    for bad in ({"model_name": SMOL, "ctx_size": 12}, {"model_name": SMOL, "ctx_size": "x"}, {"ctx_size": 2048}):
        refused = await post_json(api, "/api/v1/load", bad)
        assert refused.status_code == 400, bad
    assert (await api.delete(f"/v1/models/{SMOL}/options")).json()["saved"] == {}


async def test_max_resident_models_caps_tier1_from_the_config(api, settings, serve):
    hardware = settings.HYPNOS.hardware.model_copy(update={"max_resident_models": 1})
    models = [m.model_copy(update={"initial_tier": "tier3_nvme_ssd"}) for m in settings.HYPNOS.models[:2]]
    worker = serve(settings.HYPNOS.model_copy(update={"hardware": hardware, "models": models}))
    assert worker.tiers.max_resident == 1
    for model in (SMOL, QWEN):
        request = {"model": model, "messages": PARIS_MESSAGES, "max_tokens": 1}
        telemetry = (await post_json(api, "/v1/chat/completions", request)).json()["hypnos_telemetry"]
    assert telemetry["evicted_models"] == [SMOL]
    status = (await api.get("/v1/memory/status")).json()
    assert status["recent_evictions"][-1]["reason"] == "max_loaded_models"
    assert (await api.get(HEALTH)).json()["max_models"]["llm"] == 1


async def test_speech_streams_as_sse_with_stream_format(api):
    body = {"model": TTS, "input": "Hello there. How are you?", "response_format": "pcm"}
    whole = await post_json(api, "/v1/audio/speech", body)
    response = await post_json(api, "/v1/audio/speech", body | {"stream_format": "sse"})
    assert response.status_code == 200 and response["content-type"].startswith("text/event-stream")
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = [json.loads(block.removeprefix("data: ")) for block in raw.strip().split("\n\n")]
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert done["type"] == "speech.audio.done" and done["samples"] * 2 == len(audio)
    # Piper's noise makes each synthesis differ a little; the lengths stay close.
    assert abs(len(audio) - len(whole.content)) < 0.25 * len(whole.content)


async def test_speech_stream_format_audio_streams_the_bytes(api):
    body = {"model": TTS, "input": "Hello there.", "response_format": "wav", "stream_format": "audio"}
    response = await post_json(api, "/v1/audio/speech", body)
    assert response.status_code == 200 and response["content-type"] == "audio/wav"
    chunks = [chunk async for chunk in response.streaming_content]
    assert chunks[0][:4] == b"RIFF" and chunks[0][4:8] == b"\xff\xff\xff\xff"  # the open-ended header


@pytest.mark.parametrize("stream", [False, True])
async def test_speech_in_a_language_the_voice_cannot_speak_is_a_400_streamed_or_not(api, stream):
    body = {"model": TTS, "input": "Guten Tag.", "language": "de", "stream": stream}
    refused = await post_json(api, "/v1/audio/speech", body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "language" and "en_US" in error["message"]
    # Its own language, in any spelling, is spoken.
    for language in ("en", "en-US", "en_us"):
        spoken = await post_json(api, "/v1/audio/speech", body | {"language": language, "input": "Good day."})
        assert spoken.status_code == 200, language


async def test_a_malformed_language_is_a_400(api):
    refused = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": "Hi.", "language": "e n"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "language"
