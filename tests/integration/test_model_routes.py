"""The model routes beyond the list: one model, its files, HEAD, enable and disable."""

from __future__ import annotations

import pytest

from inference.worker import Worker
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"


@pytest.fixture
def pool(settings, serve) -> Worker:
    return serve(settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:2]}))


async def test_one_model_reads_like_a_list_entry(api, pool):
    body = (await api.get(f"/v1/models/{SMOL}")).json()
    assert body["id"] == SMOL and body["object"] == "model" and body["enabled"] is True
    assert body["current_tier"] == "tier1_gpu_vram"
    assert (await api.get("/v1/models/gpt-4o-mini")).json()["id"] == SMOL
    missing = await api.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"
    assert (await api.head("/v1/models")).status_code == 200


async def test_the_files_of_a_model_say_whether_they_exist(api, pool):
    body = (await api.get(f"/v1/models/{QWEN}/files")).json()
    [weights] = body["data"]
    assert weights["role"] == "weights" and weights["exists"] is True and weights["size_bytes"] == 491400064


async def test_a_disabled_model_is_evicted_hidden_and_refused(api, pool):
    await post_json(api, "/v1/chat/completions", {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 1})
    disabled = (await post_json(api, f"/v1/models/{QWEN}/disable", {})).json()
    assert disabled["enabled"] is False and disabled["placement"]["primary_tier"] == "tier3_nvme_ssd"
    assert QWEN not in [m["id"] for m in (await api.get("/v1/models")).json()["data"]]
    refused = await post_json(api, "/v1/chat/completions", {"model": QWEN, "messages": PARIS_MESSAGES})
    assert refused.status_code == 404 and refused.json()["error"]["type"] == "model_disabled"
    enabled = (await post_json(api, f"/v1/models/{QWEN}/enable", {})).json()
    assert enabled["enabled"] is True
    answer = await post_json(api, "/v1/chat/completions", {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 1})
    assert answer.status_code == 200
    assert answer.json()["hypnos_telemetry"]["previous_tier"] == "tier3_nvme_ssd"


async def test_disable_is_refused_while_the_model_serves(api, pool):
    pool.tiers.lease(SMOL, request=False)
    try:
        busy = await post_json(api, f"/v1/models/{SMOL}/disable", {})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "model_busy"
    finally:
        pool.tiers.release(SMOL, served=False)


async def test_the_list_says_what_pickers_read(api, pool, settings):
    """capabilities, context_length, max_context_window (the GGUF's trained context),
    downloaded, checkpoint, engine and Lemonade's recipe: a picker offers the right models."""
    listed = {m["id"]: m for m in (await api.get("/v1/models")).json()["data"]}
    smol, qwen = listed[SMOL], listed[QWEN]
    # SmolLM2 hears through its speech_to_text_model (a voice turn); Qwen's template has tools.
    assert smol["capabilities"][:2] == ["chat", "completion"] and "audio_in" in smol["capabilities"]
    assert "transcription" not in smol["capabilities"] and "tools" not in smol["capabilities"]
    assert "tools" in qwen["capabilities"] and "entities" in qwen["capabilities"]
    assert smol["context_length"] == settings.HYPNOS.models[0].context_len == 2048
    assert smol["max_context_window"] == 8192  # SmolLM2-135M-Instruct's n_ctx_train
    assert qwen["max_context_window"] == 32768
    assert smol["downloaded"] is True and smol["checkpoint"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol["engine"] == "ggml_llama" and smol["recipe"] == "llamacpp"
    assert (await api.get(f"/v1/models/{SMOL}")).json()["capabilities"] == smol["capabilities"]
