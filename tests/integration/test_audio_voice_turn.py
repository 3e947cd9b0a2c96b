"""Voice in chat: input_audio parts heard through Whisper before SmolLM2 answers (spec §7.1), and a
whole voice turn (transcription, chat, speech) declared as one workflow, the next model named on
each step (spec §1)."""

from __future__ import annotations

import base64
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
CHAT, TTS, STT = "smollm2-135m", "piper-joe", "whisper-tiny.en"
SENTENCE = "Hello world. The weather is nice today."


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


async def spoken(api, text: str = SENTENCE) -> bytes:
    response = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": text})
    assert response.status_code == 200
    return response.content


async def test_an_input_audio_part_is_transcribed_then_answered_and_the_telemetry_says_so(api):
    audio = base64.b64encode(await spoken(api)).decode()
    content = [
        {"type": "text", "text": "Repeat this sentence:"},
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
    ]
    response = await post_json(
        api,
        "/v1/chat/completions",
        {"model": CHAT, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0},
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["choices"][0]["message"]["content"]
    transcription, chat = body["hypnos_telemetry"]["pipeline"]
    assert transcription["stage"] == "transcription" and transcription["model"] == STT
    assert words(transcription["text"]).endswith("nice today")
    assert transcription["audio_secs"] > 1 and transcription["engine"]["rtf"] > 0
    assert chat == {"stage": "chat", "model": CHAT}
    # The transcript is part of the prompt the chat model read.
    assert body["usage"]["prompt_tokens"] > 15


async def test_a_streamed_chat_with_audio_reports_the_pipeline_on_its_last_chunk(api):
    audio = base64.b64encode(await spoken(api, "Good morning.")).decode()
    content = [{"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]
    response = await post_json(
        api,
        "/v1/chat/completions",
        {"model": CHAT, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": True},
    )
    assert response.status_code == 200
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    assert '"pipeline": [{"stage": "transcription"' in raw and raw.rstrip().endswith("data: [DONE]")


async def test_audio_to_a_chat_model_that_cannot_hear_is_400(api):
    content = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    response = await post_json(
        api, "/v1/chat/completions", {"model": "qwen2.5-coder-0.5b", "messages": [{"role": "user", "content": content}]}
    )
    assert response.status_code == 400 and "speech_to_text" in response.json()["error"]["message"]


async def test_audio_that_is_not_base64_is_400(api):
    content = [{"type": "input_audio", "input_audio": {"data": "%%% not base64 %%%", "format": "wav"}}]
    body = {"model": CHAT, "messages": [{"role": "user", "content": content}]}
    response = await post_json(api, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


async def test_a_voice_turn_is_one_workflow_and_each_step_brings_up_the_next_model(api):
    wav = await spoken(api)
    moved = await post_json(api, "/v1/memory/tier", {"model": TTS, "target_tier": "tier3_nvme_ssd"})
    assert moved.status_code == 200
    turn = {"x-hypnos-workflow": "voice/turn-1"}

    heard = await api.post(
        "/v1/audio/transcriptions",
        {"model": STT, "file": SimpleUploadedFile("turn.wav", wav, "audio/wav")},
        headers={**turn, "x-hypnos-next-model": CHAT},
    )
    assert heard.status_code == 200
    answer = await post_json(
        api,
        "/v1/chat/completions",
        {
            "model": CHAT,
            "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": heard.json()["text"]}],
        },
        **turn,
        **{"x-hypnos-next-model": TTS},
    )
    assert answer.status_code == 200
    reply = answer.json()["choices"][0]["message"]["content"] or "Okay."
    speech = await post_json(
        api, "/v1/audio/speech", {"model": TTS, "input": reply}, **turn, **{"x-hypnos-workflow-end": "true"}
    )
    assert speech.status_code == 200
    # Named as the next model by the chat, the voice was loaded while the chat ran.
    assert speech["x-hypnos-previous-tier"] == "tier1_gpu_vram"

    status = (await api.get("/v1/memory/status")).json()
    voice = status["latency"]["workflows"]["voice"]
    assert voice["count"] >= 1
    assert 0 < voice["p50_ms"] <= voice["p95_ms"] <= voice["p99_ms"]
    for route in ("/v1/audio/transcriptions", "/v1/chat/completions", "/v1/audio/speech"):
        assert status["latency"]["routes"][route]["count"] >= 1
