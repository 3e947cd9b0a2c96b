"""The client events of WS /v1/realtime (OpenAI Realtime, the transcription subset; compat.md),
as typed messages: each is validated before anything acts on it, so a malformed one (an object
as `type`, `audio` as a number, `session` as a string) is an `error` event naming the field,
never an exception that closes the socket with 1011."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RealtimeEvent(BaseModel):
    """What every client event has; the handler's own model reads the rest."""

    model_config = ConfigDict(extra="allow")

    type: str
    event_id: str | None = None


class TranscriptionSettings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class TurnDetection(BaseModel):
    """Server VAD's settings (the only kind served); bounds keep a turn's arithmetic sane."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(default=0.5, ge=0, le=1)
    prefix_padding_ms: int = Field(default=300, ge=0, le=10_000)
    silence_duration_ms: int = Field(default=500, ge=0, le=60_000)


class SessionFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_audio_format: str = "pcm16"
    input_audio_transcription: TranscriptionSettings | None = None
    turn_detection: TurnDetection | None = None


class SessionUpdate(RealtimeEvent):
    """session.update / transcription_session.update: only the fields it sets change."""

    session: SessionFields | None = None


class AudioAppend(RealtimeEvent):
    """input_audio_buffer.append: base64 pcm16, 24 kHz mono."""

    audio: str = ""
