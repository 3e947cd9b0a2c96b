"""WS /v1/realtime through a real websocket client against both deployments: the server's voice
activity detection ends the turn, Whisper transcribes it."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
SENTENCE = "Hello world. The weather is nice today."
RATE = 24_000


def events_until(ws, kind: str) -> list[dict]:
    seen: list[dict] = []
    while True:
        try:
            event = json.loads(ws.recv(timeout=90))
        except TimeoutError:
            pytest.fail(f"no {kind} in 90 s; received {[e['type'] for e in seen]}")
        seen.append(event)
        if event["type"] in (kind, "error", "conversation.item.input_audio_transcription.failed"):
            return seen


def test_server_vad_ends_the_turn_and_the_transcript_comes_back(server: Server):
    pcm = httpx.post(
        f"{server.base_url}/v1/audio/speech",
        timeout=60,
        json={"model": "piper-joe", "input": SENTENCE, "response_format": "pcm"},
    ).content
    url = server.base_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription&api_key=unused"
    with connect(url) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"
        # Piper's pause after "Hello world." varies with its noise (up to ~0.5 s, the default
        # silence_duration_ms): 800 ms keeps the sentence one turn, and the 1 s after it ends it.
        ws.send(
            json.dumps(
                {
                    "type": "transcription_session.update",
                    "session": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}},
                }
            )
        )
        updated = json.loads(ws.recv(timeout=10))
        assert updated["type"] == "transcription_session.updated"
        assert updated["session"]["turn_detection"]["silence_duration_ms"] == 800
        audio = bytes(RATE // 2 * 2) + pcm + bytes(RATE * 2)  # 0.5 s silence, speech, 1 s silence
        step = RATE * 2 // 10
        for start in range(0, len(audio), step):
            ws.send(
                json.dumps(
                    {
                        "type": "input_audio_buffer.append",
                        "audio": base64.b64encode(audio[start : start + step]).decode(),
                    }
                )
            )
        events = events_until(ws, "conversation.item.input_audio_transcription.completed")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.created",
    ]
    started, stopped = events[0], events[1]
    # Positions in the audio (samples counted by the VAD), not wall time: a busy machine does not
    # move them. The range is Piper's own lead-in before the speech (it varies with its noise).
    assert 450 <= started["audio_start_ms"] <= 600
    assert stopped["audio_end_ms"] > started["audio_start_ms"] + 1500
    assert events[-1]["item_id"] == started["item_id"] == stopped["item_id"]
    assert events[-1]["type"] == "conversation.item.input_audio_transcription.completed", events[-1].get("error")
    assert "nice today" in events[-1]["transcript"].lower()


def test_lemonade_clients_find_the_socket_at_realtime_on_the_advertised_port(server: Server):
    health = httpx.get(f"{server.base_url}/api/v1/health", timeout=10).json()
    host = server.base_url.removeprefix("http://").rsplit(":", 1)[0]
    url = f"ws://{host}:{health['websocket_port']}/realtime?intent=transcription&api_key=unused"
    with connect(url) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"


@pytest.mark.parametrize("path", ["/realtime/extra", "/v1/nope", "/", "/v1/chat/completions"])
def test_an_unknown_websocket_path_is_refused_at_the_handshake_not_a_500(server: Server, path: str):
    url = server.base_url.replace("http://", "ws://") + path
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10)
    assert refused.value.response.status_code == 403
    # The server is unharmed: the next request is answered.
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_a_message_over_a_mebibyte_closes_the_socket_with_1009(server: Server):
    """Once it was dropped without a close frame (autobahn fails a connection by dropping it)."""
    url = server.base_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription&api_key=unused"
    with connect(url, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"
        audio = base64.b64encode(bytes(800_000)).decode()  # 1.07 MB of JSON
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    # The server goes on: the next socket opens.
    with connect(url) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"
