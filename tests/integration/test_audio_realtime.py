"""WS /v1/realtime in-process (channels' communicator): auth, session events, manual commit, and
the server's voice activity detection, with Piper speech transcribed by Whisper."""

from __future__ import annotations

import base64

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from inference.web.openai.realtime import FRAME, RATE, ServerVad, websocket_urlpatterns
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


# The audit's malformed events (issue 35 item 3): each ended the socket with 1011 and a traceback.
MALFORMED = [
    ('{"type": {"a": 1}}', "invalid_event", None),
    ('{"type": ["input_audio_buffer.append"]}', "invalid_event", None),
    ('{"type": 7}', "invalid_event", None),
    ("[1, 2]", "invalid_event", None),
    ("not json", "invalid_event", None),
    ('{"type": "input_audio_buffer.append", "audio": 123}', "invalid_value", "audio"),
    ('{"type": "input_audio_buffer.append", "audio": ["AAAA"]}', "invalid_value", "audio"),
    ('{"type": "session.update", "session": "pcm16"}', "invalid_value", "session"),
    ('{"type": "session.update", "session": {"input_audio_transcription": "en"}}', "invalid_value", None),
    ('{"type": "session.update", "session": {"turn_detection": "server_vad"}}', "invalid_value", None),
    ('{"type": "session.update", "session": {"turn_detection": {"threshold": "loud"}}}', "invalid_value", None),
    ('{"type": "session.update", "session": {"turn_detection": {"silence_duration_ms": -5}}}', "invalid_value", None),
    ('{"type": "session.update", "session": {"input_audio_format": 16}}', "invalid_value", None),
]


async def test_a_malformed_event_is_an_error_event_and_the_session_goes_on(api):
    communicator = await session()
    await communicator.receive_json_from(10)  # created
    for text, code, param in MALFORMED:
        await communicator.send_to(text_data=text)
        event = await communicator.receive_json_from(10)
        assert event["type"] == "error" and event["error"]["code"] == code, (text, event)
        if param is not None:
            assert event["error"]["param"] == param, (text, event)
    # Still the same session: a valid update is answered.
    await communicator.send_json_to({"type": "transcription_session.update", "session": {"turn_detection": None}})
    updated = await communicator.receive_json_from(10)
    assert updated["type"] == "transcription_session.updated" and updated["session"]["turn_detection"] is None
    await communicator.disconnect()


async def test_committed_audio_waiting_for_its_transcript_is_bounded(api, settings):
    """The audit queued 400 turns (99.6 min of audio, +399 MB) in 16.5 s: turns waiting for the
    transcriber hold at most limits.max_audio_bytes, and one past it is dropped with an error."""
    from tests.integration.conftest import with_limits

    with_limits(settings, max_audio_bytes=RATE * 2 * 3)  # 3 s of pcm16 waiting at most
    communicator = await session()
    await communicator.receive_json_from(10)
    await communicator.send_json_to({"type": "transcription_session.update", "session": {"turn_detection": None}})
    await communicator.receive_json_from(10)
    second = base64.b64encode(b"\x00\x01" * RATE).decode()  # one second of pcm16
    outcomes = []
    for _ in range(8):
        await communicator.send_json_to({"type": "input_audio_buffer.append", "audio": second})
        await communicator.send_json_to({"type": "input_audio_buffer.commit"})
        while True:  # the commit's answer; transcripts of earlier turns may come in between
            event = await communicator.receive_json_from(30)
            if event["type"] in ("input_audio_buffer.committed", "error"):
                break
        outcomes.append(event["type"] if event["type"] != "error" else event["error"]["code"])
    # The transcriber holds one turn and at most 3 s more wait: the commits sent meanwhile are
    # dropped, each with its error, and the session goes on.
    assert outcomes[0] == "input_audio_buffer.committed" and "turn_queue_full" in outcomes, outcomes
    assert set(outcomes) == {"input_audio_buffer.committed", "turn_queue_full"}, outcomes
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
