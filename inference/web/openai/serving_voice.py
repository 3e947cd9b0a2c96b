"""Chat input_audio parts (spec §7.1) on a chat model without an audio encoder: each clip is
transcribed by the model's `speech_to_text_model` first, the part becomes the transcript's text,
and the answer's hypnos_telemetry says so (`pipeline`: the transcription, then the chat)."""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest
from inference.transport.client import Event, InferenceCall, InferenceClient
from inference.transport.transcripts import Transcript
from inference.transport.wire import Done
from inference.web.common.context import RequestContext
from inference.web.openai.protocol import ChatCompletionRequest, InputAudioPart, TextPart
from inference.web.openai.protocol_media import TranscriptionRequest
from inference.web.openai.serving_audio import transcribe


async def transcribe_audio_parts(
    client: InferenceClient, body: ChatCompletionRequest, model: ModelConfig, ctx: RequestContext
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The request with its input_audio parts replaced by their transcripts, and one pipeline
    stage per clip. Unchanged when there is no audio or the model hears audio itself."""
    clips = [
        p for m in body.messages if isinstance(m.content, list) for p in m.content if isinstance(p, InputAudioPart)
    ]
    if not clips or model.modality == "speech_to_text" or not model.speech_to_text_model:
        return body, []
    stages: list[dict[str, Any]] = []
    transcripts: dict[int, str] = {}
    for clip in clips:
        audio = _clip_bytes(clip)
        # The chat model is named as the next one, so it is brought up while Whisper runs.
        stage_ctx = RequestContext("req-" + uuid.uuid4().hex, ctx.deadline_ms, next_model=model.id)
        request = TranscriptionRequest(model=model.speech_to_text_model, filename=f"clip.{clip.input_audio.format}")
        _call, done = await transcribe(client, request, audio, stage_ctx, param="messages")
        result = done.result
        assert isinstance(result, Transcript)
        transcripts[id(clip)] = result.text
        stages.append(
            {
                "stage": "transcription",
                "model": model.speech_to_text_model,
                "text": result.text,
                "audio_secs": result.duration_secs,
                **done.telemetry,
            }
        )
    messages = []
    for message in body.messages:
        if isinstance(message.content, list):
            parts = [
                TextPart(type="text", text=transcripts[id(p)]) if isinstance(p, InputAudioPart) else p
                for p in message.content
            ]
            message = message.model_copy(update={"content": parts})
        messages.append(message)
    return body.model_copy(update={"messages": messages}), stages


def _clip_bytes(part: InputAudioPart) -> bytes:
    try:
        return base64.b64decode(part.input_audio.data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("input_audio.data must be base64-encoded audio", param="messages") from None


def reporting(call: InferenceCall, stages: list[dict[str, Any]], model: str) -> InferenceCall:
    """The chat call, its final telemetry carrying the transcription stages before the chat."""
    return call if not stages else _Pipeline(call, stages, model)


class _Pipeline(InferenceCall):
    def __init__(self, inner: InferenceCall, stages: list[dict[str, Any]], model: str):
        super().__init__(inner.request_id)
        self.inner, self.stages, self.model = inner, stages, model
        self.estimated_wait_ms = getattr(inner, "estimated_wait_ms", None)
        self.stall_timeout, self.record = inner.stall_timeout, inner.record

    async def next_event(self) -> Event:
        event = await self.inner.next_event()
        if isinstance(event, Done):
            event.telemetry["pipeline"] = [*self.stages, {"stage": "chat", "model": self.model}]
        return event

    async def abort(self) -> None:
        await self.inner.abort()
