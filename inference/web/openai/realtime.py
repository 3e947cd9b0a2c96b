"""WS /v1/realtime: realtime transcription with OpenAI Realtime events (compat.md).

A channels consumer in the web process. The client streams pcm16 audio (24 kHz, mono, little
endian, base64) with `input_audio_buffer.append`; a turn ends when the client commits it
(`input_audio_buffer.commit`, turn_detection null) or when the server's voice activity detection
hears the speaker stop (`server_vad`, the default). Each committed turn is transcribed by a
speech_to_text model through the same InferenceClient as POST /v1/audio/transcriptions, and the
transcript comes back as `conversation.item.input_audio_transcription.delta` / `.completed`.

Auth: `Authorization: Bearer <key>` on the upgrade request, or `?api_key=<key>` (browsers cannot
set headers on a WebSocket). A refused key gets an `error` event, then the socket closes (1008).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import struct
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.urls import path, re_path
from pydantic import ValidationError

from hypnos_site.errors import HypnosError, ServerError
from inference.transport.runtime import get_client
from inference.transport.transcripts import Transcript
from inference.web.common.context import RequestContext
from inference.web.common.protocol import union_tag
from inference.web.common.render import ws_error
from inference.web.openai.protocol_media import TranscriptionRequest
from inference.web.openai.protocol_realtime import AudioAppend, RealtimeEvent, SessionFields, SessionUpdate

log = logging.getLogger(__name__)
RATE = 24_000  # pcm16 in the Realtime API is 24 kHz mono
FRAME = RATE // 50  # 20 ms frames for the voice activity detection
DEFAULT_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
# An RMS level (full scale 1.0) counts as voice above threshold x this: 0.5 -> -34 dBFS.
VAD_LEVEL_PER_THRESHOLD = 0.04
# Speech starts after this many voiced frames in a row (a click is not a word).
VAD_START_FRAMES = 2
# The model each handled event is read with (the rest have no fields of their own).
EVENT_MODELS: dict[str, type[RealtimeEvent]] = {
    "session.update": SessionUpdate,
    "transcription_session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
}
# Close codes of RFC 6455 §7.4.1 a server may send, beyond 1000.
RFC_SERVER_CLOSE_CODES = frozenset({1001, 1003, 1007, 1008, 1009, 1011, 1012, 1013})


def allow_rfc_close_codes() -> None:
    """Let daphne send RFC 6455's close codes. Its autobahn layer accepts from an application
    only 1000 and 3000-4999 (the browser API's rule), so the 1008 (policy violation) of a refused
    key raised inside daphne and the socket closed with 1011 instead (autobahn-python#1642,
    daphne#374). The frame goes through autobahn's own sendCloseFrame, which its protocol-level
    closes use; every other code keeps daphne's path. Idempotent; nothing to do without daphne."""
    try:
        from daphne.ws_protocol import WebSocketProtocol
    except ImportError:
        return
    original = WebSocketProtocol.serverClose
    if getattr(original, "sends_rfc_codes", False):
        return

    def server_close(self: Any, code: int | None = None) -> None:
        if code in RFC_SERVER_CLOSE_CODES:
            self.sendCloseFrame(code=code, isReply=False)
        else:
            original(self, code)

    server_close.sends_rfc_codes = True  # type: ignore[attr-defined]
    WebSocketProtocol.serverClose = server_close


allow_rfc_close_codes()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def wav_bytes(pcm: bytes) -> bytes:
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(pcm))
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", len(pcm))
        + pcm
    )


def frame_level(pcm: bytes) -> float:
    """The RMS of 16-bit little-endian samples, full scale 1.0."""
    count = len(pcm) // 2
    if not count:
        return 0.0
    samples = struct.unpack(f"<{count}h", pcm[: count * 2])
    return math.sqrt(sum(s * s for s in samples) / count) / 32768.0


@dataclass
class ServerVad:
    """Energy-based voice activity over 20 ms frames: a turn starts at the first voiced frames
    and ends after `silence_duration_ms` without voice. Positions are samples since the session
    started."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    speaking: bool = False
    start: int = 0
    last_voice_end: int = 0
    voiced_run: int = 0
    pending: bytearray = field(default_factory=bytearray)

    def feed(self, pcm: bytes, end: int) -> list[tuple[str, int]]:
        """The whole frames of what is pending plus `pcm` (which ends at sample `end`) ->
        ("started", sample) and ("stopped", sample) transitions."""
        self.pending += pcm
        at = end - len(self.pending) // 2
        events = []
        while len(self.pending) >= FRAME * 2:
            frame, self.pending = bytes(self.pending[: FRAME * 2]), self.pending[FRAME * 2 :]
            voiced = frame_level(frame) >= self.threshold * VAD_LEVEL_PER_THRESHOLD
            at += FRAME
            if voiced:
                self.voiced_run += 1
                self.last_voice_end = at
                if not self.speaking and self.voiced_run >= VAD_START_FRAMES:
                    self.speaking = True
                    self.start = at - VAD_START_FRAMES * FRAME
                    events.append(("started", self.start))
            else:
                self.voiced_run = 0
                if self.speaking and (at - self.last_voice_end) * 1000 >= self.silence_duration_ms * RATE:
                    self.speaking = False
                    events.append(("stopped", at))
        return events


class RealtimeConsumer(AsyncWebsocketConsumer):
    """One realtime transcription session."""

    # No channel-layer inbox for the consumer: it only talks to its socket and, through the
    # InferenceClient, to the worker. (With one, channels-redis would hold its receive lock on the
    # consumer's inbox while the client's reply channel, another local prefix, waited behind it.)
    channel_layer_alias = None
    # Set when the key was refused: the socket is closing (1008), and what the client sent
    # meanwhile is dropped (handling it without a session raised, which closed with 1011).
    refused = False

    async def connect(self) -> None:
        await self.accept()
        query = parse_qs(self.scope.get("query_string", b"").decode())
        headers = {k.decode().lower(): v.decode() for k, v in self.scope.get("headers", [])}
        header = headers.get("authorization") or (f"Bearer {query['api_key'][0]}" if "api_key" in query else "")
        from models_registry.authentication import check_authorization

        check = await database_sync_to_async(check_authorization)(header)
        if check.refused:
            self.refused = True
            await self.send_event(
                "error",
                error={
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                    "message": check.problem,
                    "param": None,
                },
            )
            await self.close(code=1008)
            return
        self.transcription_session = query.get("intent", [""])[0] == "transcription"
        self.session: dict[str, Any] = {
            "id": _id("sess"),
            "object": "realtime.transcription_session" if self.transcription_session else "realtime.session",
            "input_audio_format": "pcm16",
            "input_audio_transcription": {
                "model": self._model(query.get("model", [""])[0]),
                "language": None,
                "prompt": "",
            },
            "turn_detection": dict(DEFAULT_VAD),
        }
        self.buffer = bytearray()
        self.buffer_start = 0  # sample position of buffer[0] since the session started
        self.received = 0  # samples received since the session started
        self.vad: ServerVad | None = self._vad()
        self.item_id: str | None = None
        self.previous_item_id: str | None = None
        self.turns: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        # Audio of the committed turns not yet taken by the transcriber: at most what one turn
        # may hold (limits.max_audio_bytes / max_audio_secs); a commit past it is refused.
        self.queued_bytes = 0
        self.worker_task = asyncio.ensure_future(self._transcribe_turns())
        await self.send_event(self._kind("created"), session=self.session)

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "worker_task", None)
        if task is not None:
            task.cancel()
        # The session's audio goes with the socket, whenever the consumer itself is collected.
        self.buffer = bytearray()
        turns = getattr(self, "turns", None)
        while turns is not None and not turns.empty():
            turns.get_nowait()
        self.queued_bytes = 0

    @staticmethod
    def _model(name: str) -> str | None:
        """The URL's `model` when it names a speech_to_text model; else the first one configured
        (OpenAI clients put their conversation model, e.g. gpt-4o-realtime-preview, there)."""
        from inference.web.common.pool import pool

        hearing = [m for m in pool.models() if m.modality == "speech_to_text" and m.enabled]
        chosen = next((m for m in hearing if name in (m.id, *m.aliases)), hearing[0] if hearing else None)
        return chosen.id if chosen else None

    def _kind(self, what: str) -> str:
        return f"{'transcription_session' if self.transcription_session else 'session'}.{what}"

    def _vad(self) -> ServerVad | None:
        detection = self.session.get("turn_detection")
        if not detection:
            return None
        return ServerVad(
            threshold=float(detection.get("threshold", 0.5)),
            prefix_padding_ms=int(detection.get("prefix_padding_ms", 300)),
            silence_duration_ms=int(detection.get("silence_duration_ms", 500)),
        )

    async def send_event(self, kind: str, **fields: Any) -> None:
        await self.send(text_data=json.dumps({"event_id": _id("event"), "type": kind, **fields}))

    async def error(self, message: str, code: str, event_id: str | None = None, param: str | None = None) -> None:
        await self.send_event(
            "error",
            error={
                "type": "invalid_request_error",
                "code": code,
                "message": message,
                "param": param,
                "event_id": event_id,
            },
        )

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.refused:
            return
        try:
            event = RealtimeEvent.model_validate_json(text_data or "")
        except ValidationError:
            await self.error("Each message must be a JSON object with a string `type`.", "invalid_event")
            return
        kind = event.type
        handlers: dict[str, Callable[[Any], Awaitable[None]]] = {
            "session.update": self._update,
            "transcription_session.update": self._update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit_request,
            "input_audio_buffer.clear": self._clear,
        }
        handler = handlers.get(kind)
        if handler is None:
            await self.error(
                f"Unsupported event type {kind[:100]!r}: this server does realtime transcription.",
                "unsupported_event",
                event.event_id,
            )
            return
        model = EVENT_MODELS.get(kind, RealtimeEvent)
        try:
            typed = model.model_validate(event.model_dump())
        except ValidationError as exc:
            problem = exc.errors()[0]
            param = ".".join(str(p) for p in problem["loc"] if not union_tag(p)) or None
            await self.error(f"Invalid value for {param}: {problem['msg']}", "invalid_value", event.event_id, param)
            return
        await handler(typed)

    async def _update(self, event: SessionUpdate) -> None:
        update = event.session or SessionFields()
        if update.input_audio_format != "pcm16":
            await self.error(
                "input_audio_format must be pcm16 (24 kHz mono).",
                "invalid_value",
                event.event_id,
                "session.input_audio_format",
            )
            return
        given = update.model_fields_set
        if "input_audio_transcription" in given and update.input_audio_transcription is not None:
            self.session["input_audio_transcription"].update(
                update.input_audio_transcription.model_dump(exclude_unset=True)
            )
        if "turn_detection" in given:
            detection = update.turn_detection
            self.session["turn_detection"] = (
                {**DEFAULT_VAD, **detection.model_dump(exclude_unset=True)} if detection else None
            )
            self.vad = self._vad()
        await self.send_event(self._kind("updated"), session=self.session)

    async def _append(self, event: AudioAppend) -> None:
        try:
            pcm = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            await self.error("audio must be base64-encoded pcm16.", "invalid_value", event.event_id, "audio")
            return
        limits = settings.HYPNOS.limits
        if len(self.buffer) + len(pcm) > limits.max_audio_bytes:
            await self.error(
                f"The input audio buffer would exceed limits.max_audio_bytes ({limits.max_audio_bytes}).",
                "buffer_too_large",
                event.event_id,
                "audio",
            )
            return
        # pcm16 at 24 kHz: two bytes a sample. A turn longer than this would be refused anyway.
        if (len(self.buffer) + len(pcm)) / (2 * RATE) > limits.max_audio_secs:
            await self.error(
                f"The input audio buffer would exceed limits.max_audio_secs "
                f"({limits.max_audio_secs:g} s); commit or clear it.",
                "buffer_too_large",
                event.event_id,
                "audio",
            )
            return
        self.buffer += pcm
        self.received += len(pcm) // 2
        if self.vad is None:
            return
        for change, sample in self.vad.feed(pcm, self.received):
            if change == "started":
                self.item_id = _id("item")
                # Keep the prefix padding before the speech, drop older silence.
                keep_from = max(sample - self.vad.prefix_padding_ms * RATE // 1000, self.buffer_start)
                del self.buffer[: (keep_from - self.buffer_start) * 2]
                self.buffer_start = keep_from
                await self.send_event(
                    "input_audio_buffer.speech_started", audio_start_ms=sample * 1000 // RATE, item_id=self.item_id
                )
            else:
                await self.send_event(
                    "input_audio_buffer.speech_stopped", audio_end_ms=sample * 1000 // RATE, item_id=self.item_id
                )
                await self._commit(upto=sample)

    async def _commit_request(self, event: RealtimeEvent) -> None:
        if not self.buffer:
            await self.error("The input audio buffer is empty.", "input_audio_buffer_commit_empty", event.event_id)
            return
        await self._commit(upto=self.received, event_id=event.event_id)

    async def _commit(self, upto: int, event_id: str | None = None) -> None:
        cut = (upto - self.buffer_start) * 2
        audio, self.buffer = bytes(self.buffer[:cut]), self.buffer[cut:]
        self.buffer_start = upto
        limits = settings.HYPNOS.limits
        queued = self.queued_bytes + len(audio)
        if queued > limits.max_audio_bytes or queued / (2 * RATE) > limits.max_audio_secs:
            # Turns arrive faster than they are transcribed: this one is dropped, not queued.
            self.item_id = None
            await self.error(
                "Too much committed audio is waiting to be transcribed (limits.max_audio_bytes / "
                "max_audio_secs for all waiting turns); this turn was dropped. Wait for the "
                "transcripts of the turns before it.",
                "turn_queue_full",
                event_id,
            )
            return
        self.queued_bytes = queued
        item_id, self.item_id = self.item_id or _id("item"), None
        await self.send_event("input_audio_buffer.committed", previous_item_id=self.previous_item_id, item_id=item_id)
        await self.send_event(
            "conversation.item.created",
            previous_item_id=self.previous_item_id,
            item={
                "id": item_id,
                "object": "realtime.item",
                "type": "message",
                "status": "completed",
                "role": "user",
                "content": [{"type": "input_audio", "transcript": None}],
            },
        )
        self.previous_item_id = item_id
        await self.turns.put((item_id, audio))

    async def _clear(self, event: RealtimeEvent) -> None:
        self.buffer = bytearray()
        self.buffer_start = self.received
        self.item_id = None
        if self.vad is not None:
            self.vad = self._vad()
        await self.send_event("input_audio_buffer.cleared")

    async def _transcribe_turns(self) -> None:
        """Committed turns, one at a time, in order."""
        from inference.web.openai.serving_audio import transcribe

        while True:
            turn = await self.turns.get()
            if turn is None:
                return
            item_id, audio = turn
            self.queued_bytes -= len(audio)
            options = self.session["input_audio_transcription"]
            try:
                request = TranscriptionRequest(
                    model=options.get("model") or "",
                    language=options.get("language"),
                    prompt=options.get("prompt") or None,
                )
                ctx = RequestContext("req-" + uuid.uuid4().hex)
                _call, done = await transcribe(get_client(), request, wav_bytes(audio), ctx)
            except Exception as exc:  # a turn must not end the session
                if not isinstance(exc, HypnosError):
                    log.exception("realtime transcription failed")
                    exc = ServerError(f"{type(exc).__name__}: {exc}")
                await self.send_event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item_id,
                    content_index=0,
                    error=ws_error(exc),
                )
                continue
            result = done.result
            assert isinstance(result, Transcript)
            for segment in result.segments:
                await self.send_event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item_id,
                    content_index=0,
                    delta=segment.text,
                )
            await self.send_event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=result.text,
                hypnos_telemetry=done.telemetry,
            )


class UnknownPathConsumer(AsyncWebsocketConsumer):
    """Any other WebSocket path: the handshake is refused (daphne answers it 403), where an
    unrouted path used to raise inside the router and end as a 500."""

    async def connect(self) -> None:
        log.info("WebSocket refused: no route for %s", self.scope.get("path"))
        await self.close()


websocket_urlpatterns = [
    path("v1/realtime", RealtimeConsumer.as_asgi()),
    path("api/v1/realtime", RealtimeConsumer.as_asgi()),
    # Lemonade's legacy path, on its websocket_port (which /api/v1/health gives as this port).
    path("realtime", RealtimeConsumer.as_asgi()),
    re_path(r"", UnknownPathConsumer.as_asgi()),
]
