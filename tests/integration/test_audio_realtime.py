"""WS /v1/realtime in-process (channels' communicator): auth, session events, manual commit, and
the server's voice activity detection, with Piper speech transcribed by Whisper."""

from __future__ import annotations

import base64

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from inference.realtime import FRAME, RATE, ServerVad, websocket_urlpatterns
from tests.integration.conftest import post_json, with_server

pytestmark = pytest.mark.django_db(transaction=True)
APP = URLRouter(websocket_urlpatterns)
SENTENCE = "Hello world. The weather is nice today."


async def pcm16(api, text: str = SENTENCE) -> bytes:
    response = await post_json(api, "/v1/audio/speech", {"model": "piper-joe", "input": text, "response_format": "pcm"})
    assert response.status_code == 200
    return response.content


async def session(path: str = "/v1/realtime?intent=transcription", headers=None) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(APP, path, headers=headers or [])
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def until(communicator: WebsocketCommunicator, kind: str, timeout: float = 60) -> list[dict]:
    """Every event up to and including the first of `kind`."""
    seen = []
    while True:
        event = await communicator.receive_json_from(timeout)
        seen.append(event)
        if event["type"] in (kind, "error"):
            return seen


async def send_audio(communicator: WebsocketCommunicator, pcm: bytes, chunk_ms: int = 100) -> None:
    step = RATE * 2 * chunk_ms // 1000
    for start in range(0, len(pcm), step):
        await communicator.send_json_to(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[start : start + step]).decode()}
        )


async def test_a_key_is_needed_when_keys_are_configured(api, settings):
    with_server(settings, api_keys=["sk-realtime"])
    refused = await session()
    event = await refused.receive_json_from(10)
    assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
    assert (await refused.receive_output(10))["type"] == "websocket.close"
    by_query = await session("/v1/realtime?intent=transcription&api_key=sk-realtime")
    assert (await by_query.receive_json_from(10))["type"] == "transcription_session.created"
    await by_query.disconnect()
    by_header = await session("/v1/realtime", headers=[(b"authorization", b"Bearer sk-realtime")])
    assert (await by_header.receive_json_from(10))["type"] == "session.created"
    await by_header.disconnect()


async def test_manual_commit_transcribes_the_buffer(api):
    audio = await pcm16(api)
    communicator = await session()
    created = await communicator.receive_json_from(10)
    assert created["session"]["input_audio_transcription"]["model"] == "whisper-tiny.en"
    update = {"turn_detection": None, "input_audio_transcription": {"language": "en"}}
    await communicator.send_json_to({"type": "transcription_session.update", "session": update})
    updated = await communicator.receive_json_from(10)
    assert updated["type"] == "transcription_session.updated" and updated["session"]["turn_detection"] is None
    await send_audio(communicator, audio)
    await communicator.send_json_to({"type": "input_audio_buffer.commit"})
    events = await until(communicator, "conversation.item.input_audio_transcription.completed")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["input_audio_buffer.committed", "conversation.item.created"]
    assert "conversation.item.input_audio_transcription.delta" in kinds
    completed = events[-1]
    assert completed["item_id"] == events[0]["item_id"]
    assert "nice today" in completed["transcript"].lower()
    await communicator.disconnect()


async def test_an_empty_commit_and_an_unknown_event_are_errors(api):
    # OpenAI clients name their conversation model in the URL: the session still hears with Whisper.
    communicator = await session("/v1/realtime?model=gpt-4o-realtime-preview")
    created = await communicator.receive_json_from(10)
    assert created["session"]["input_audio_transcription"]["model"] == "whisper-tiny.en"
    await communicator.send_json_to({"type": "input_audio_buffer.commit"})
    assert (await communicator.receive_json_from(10))["error"]["code"] == "input_audio_buffer_commit_empty"
    await communicator.send_json_to({"type": "response.create"})
    assert (await communicator.receive_json_from(10))["error"]["code"] == "unsupported_event"
    await communicator.send_json_to({"type": "input_audio_buffer.append", "audio": "%%%"})
    assert (await communicator.receive_json_from(10))["error"]["param"] == "audio"
    await communicator.disconnect()


def test_the_vad_finds_a_turn_between_silences():
    silence = bytes(RATE // 2 * 2)
    # One second of a 600 Hz square wave at a quarter of full scale.
    tone = b"".join(int(8000 * ((i // 20) % 2 * 2 - 1)).to_bytes(2, "little", signed=True) for i in range(RATE))
    vad = ServerVad(silence_duration_ms=500)
    changes = []
    received = 0
    for piece in (silence, tone, silence, silence):
        received += len(piece) // 2
        changes += vad.feed(piece, received)
    (started, at_start), (stopped, at_stop) = changes
    assert (started, stopped) == ("started", "stopped")
    assert at_start == RATE // 2  # the tone begins after 0.5 s of silence
    assert at_stop == RATE // 2 + RATE + RATE // 2  # 500 ms of silence after it ends
    assert at_stop % FRAME == 0
