"""POST /v1/audio/transcriptions and POST /v1/audio/speech (spec §9, §10, compat.md).

Uploads reach the worker inline (base64) when small, else through a spool file the worker
reads and removes (the channel layer caps a message near 1 MB; web and worker share the
machine's `data_dir`). Speech comes back as audio events, sent on as they arrive."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from django.conf import settings
from django.http import HttpResponse, HttpResponseBase, JsonResponse, StreamingHttpResponse

from hypnos_site.errors import HypnosError, InvalidRequest
from inference.transport.client import InferenceCall, InferenceClient
from inference.transport.deadline import within
from inference.transport.transcripts import Segment, Transcript
from inference.transport.wire import AudioChunk, Done, SpeechMade, SpeechWork, TranscribeWork
from inference.web.common.context import (
    RequestContext,
    check_prompt_chars,
    request_timed_out,
    resolve_model,
    start_call,
    with_wait_estimate,
)
from inference.web.common.protocol import parse_body
from inference.web.common.render import error_fields, sse_data
from inference.web.openai.protocol_media import SpeechRequest, TranscriptionRequest

INLINE_AUDIO_BYTES = 512 << 10
CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
}
# verbose_json names the language as Whisper does; other codes are passed through.
LANGUAGE_NAMES = {
    "en": "english",
    "de": "german",
    "fr": "french",
    "es": "spanish",
    "it": "italian",
    "pt": "portuguese",
    "nl": "dutch",
    "ja": "japanese",
    "zh": "chinese",
    "ru": "russian",
}


# -- transcriptions ------------------------------------------------------------------------


def transcription_request(data: Any) -> tuple[TranscriptionRequest, bytes]:
    """The fields and the audio of a transcription: multipart (`file` and text parts, what the
    OpenAI SDKs send) or JSON (`audio_bytes`, an array of byte values)."""
    if isinstance(data, dict) and not hasattr(data, "getlist"):
        fields: dict[str, Any] = dict(data)
        raw = fields.pop("audio_bytes", None)
        if not isinstance(raw, list) or not all(isinstance(b, int) and 0 <= b <= 255 for b in raw):
            raise InvalidRequest("audio_bytes must be an array of byte values (0-255)", param="audio_bytes")
        return parse_body(TranscriptionRequest, fields), bytes(raw)
    if not hasattr(data, "getlist"):
        raise InvalidRequest("The request body must be multipart/form-data or a JSON object.")
    upload = data.get("file")
    if upload is None or not hasattr(upload, "read"):
        raise InvalidRequest("The multipart body needs a `file` part with the audio.", param="file")
    fields = {
        k: data.get(k) for k in ("model", "language", "prompt", "response_format") if data.get(k) not in (None, "")
    }
    fields["filename"] = getattr(upload, "name", None)
    fields["timestamp_granularities"] = data.getlist("timestamp_granularities[]") or data.getlist(
        "timestamp_granularities"
    )
    if data.get("temperature") not in (None, ""):
        try:
            fields["temperature"] = float(data.get("temperature"))
        except ValueError:
            raise InvalidRequest("temperature must be a number", param="temperature") from None
    limit = settings.HYPNOS.limits.max_audio_bytes
    if upload.size > limit:
        raise InvalidRequest(f"The audio is {upload.size} bytes, above limits.max_audio_bytes ({limit}).", param="file")
    return parse_body(TranscriptionRequest, fields), upload.read()


def audio_payload(audio: bytes, request_id: str, param: str = "file") -> dict[str, Any]:
    """The upload for the worker: inline when small, else a spool file."""
    limit = settings.HYPNOS.limits.max_audio_bytes
    if len(audio) > limit:
        raise InvalidRequest(f"The audio is {len(audio)} bytes, above limits.max_audio_bytes ({limit}).", param=param)
    if not audio:
        raise InvalidRequest("The audio file is empty.", param=param)
    if len(audio) <= INLINE_AUDIO_BYTES:
        return {"audio": base64.b64encode(audio).decode()}
    spool = settings.HYPNOS.data_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{request_id}-{uuid.uuid4().hex[:8]}.audio"
    path.write_bytes(audio)
    return {"audio_path": str(path)}


def check_declared_secs(audio: bytes, max_secs: float, param: str) -> None:
    """400 when the audio's container declares a duration above limits.max_audio_secs, read
    from its header, so such a file never queues for the model. The worker enforces the cap
    again while decoding (a header can lie or say nothing); audio FFmpeg cannot open is left
    to it too, since it names the reason."""
    try:
        import av
    except ImportError:  # a web host without the media packages: the worker's check stands
        return
    try:
        with av.open(io.BytesIO(audio), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                return
            stream = container.streams.audio[0]
            if container.duration:
                declared = container.duration / av.time_base
            elif stream.duration and stream.time_base:
                declared = float(stream.duration * stream.time_base)
            else:
                return
    except (av.FFmpegError, ValueError, EOFError):
        return
    if declared > max_secs:
        raise InvalidRequest(
            f"The audio is {declared:.1f} s long, above limits.max_audio_secs ({max_secs:g} s).", param=param
        )


async def transcribe(
    client: InferenceClient, body: TranscriptionRequest, audio: bytes, ctx: RequestContext, param: str = "file"
) -> tuple[InferenceCall, Done]:
    """Run a transcription to its end: the call and its Done (result and telemetry).
    `param` is the request field the audio came in (input_audio clips: `messages`)."""
    model = await resolve_model(client, body.model, ctx)
    max_secs = settings.HYPNOS.limits.max_audio_secs
    work = TranscribeWork(
        **audio_payload(audio, ctx.request_id, param),
        language=body.language,
        prompt=body.prompt,
        temperature=float(body.temperature),
        word_timestamps="word" in body.timestamp_granularities,
        max_audio_secs=float(max_secs),
        audio_param=param,
    )
    try:
        await asyncio.to_thread(check_declared_secs, audio, max_secs, param)
        call, _started = await start_call(client, model, work, ctx)
        return call, (await call.drain()).done
    finally:
        # The worker removes a spool file once read; this covers a request refused or aborted first.
        _drop_spool(work)


async def create_transcription(
    client: InferenceClient, body: TranscriptionRequest, audio: bytes, ctx: RequestContext
) -> HttpResponseBase:
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, done = await within(transcribe(client, body, audio, ctx), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    result, telemetry = done.result, done.telemetry
    assert isinstance(result, Transcript)
    fmt = body.response_format
    if fmt in ("json", "verbose_json"):
        shaped = _json_transcript(result, body) if fmt == "json" else _verbose_transcript(result, body)
        response: HttpResponse = JsonResponse({**shaped, "hypnos_telemetry": telemetry})
    else:
        text = {"text": result.text + "\n", "srt": srt(result.segments), "vtt": vtt(result.segments)}[fmt]
        response = HttpResponse(text, content_type=f"text/{'vtt' if fmt == 'vtt' else 'plain'}; charset=utf-8")
        telemetry_headers(response, telemetry)
    return with_wait_estimate(response, call)


def _usage(result: Transcript) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(result.duration_secs)}


def _json_transcript(result: Transcript, body: TranscriptionRequest) -> dict[str, Any]:
    shaped: dict[str, Any] = {"text": result.text, "duration_secs": result.duration_secs, "usage": _usage(result)}
    if body.language:
        shaped["language"] = body.language
    return shaped


def _verbose_transcript(result: Transcript, body: TranscriptionRequest) -> dict[str, Any]:
    language = result.language or body.language or ""
    shaped: dict[str, Any] = {
        "task": "transcribe",
        "language": LANGUAGE_NAMES.get(language, language),
        "duration": result.duration_secs,
        "duration_secs": result.duration_secs,
        "text": result.text,
        "segments": [{k: v for k, v in asdict(s).items() if k != "words"} for s in result.segments],
        "usage": _usage(result),
    }
    if "word" in body.timestamp_granularities:
        shaped["words"] = [asdict(w) for s in result.segments for w in s.words or []]
    return shaped


def _clock(secs: float, separator: str) -> str:
    millis = round(secs * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{millis:03d}"


def srt(segments: list[Segment]) -> str:
    return "".join(
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n" for i, s in enumerate(segments, 1)
    )


def vtt(segments: list[Segment]) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n" for s in segments
    )


def _drop_spool(work: TranscribeWork) -> None:
    if work.audio_path:
        from pathlib import Path

        Path(work.audio_path).unlink(missing_ok=True)


# -- speech --------------------------------------------------------------------------------


async def create_speech(client: InferenceClient, body: SpeechRequest, ctx: RequestContext) -> HttpResponseBase:
    model = await resolve_model(client, body.model, ctx)
    check_prompt_chars(len(body.input), "input")
    if not body.input.strip():
        raise InvalidRequest("input holds no text to speak", param="input")
    # stream: true and OpenAI's stream_format "audio" stream the bytes; "sse" streams events.
    streamed = body.stream or body.stream_format is not None
    work = SpeechWork(
        input=body.input,
        voice=body.voice,
        speed=float(body.speed),
        response_format=body.response_format,
        stream=streamed,
        language=body.language,
    )
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, started = await within(start_call(client, model, work, ctx), timeout)
        content_type = CONTENT_TYPES[body.response_format]
        if streamed:
            if body.stream_format == "sse":
                response: HttpResponseBase = StreamingHttpResponse(
                    _audio_events(call), content_type="text/event-stream"
                )
            else:
                response = StreamingHttpResponse(_audio_stream(call), content_type=content_type)
            response["Cache-Control"] = "no-cache"
            response["x-hypnos-previous-tier"] = started.previous_tier
            response["x-hypnos-gpu-layers"] = str(started.gpu_layers)
            response["x-hypnos-switch-ms"] = str(started.tier_switch_ms)
            return with_wait_estimate(response, call)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    response = HttpResponse(b"".join(drained.audio), content_type=content_type)
    telemetry_headers(response, drained.done.telemetry)
    # Hypnos extension: the samples synthesized (24 kHz), for clients that check completeness.
    made = drained.done.result
    assert isinstance(made, SpeechMade)
    response["x-hypnos-audio-samples"] = str(made.samples)
    return with_wait_estimate(response, call)


def telemetry_headers(response: HttpResponse, telemetry: dict[str, Any]) -> None:
    """Spec §5: the facts of hypnos_telemetry on a response that is not JSON."""
    engine = telemetry["engine"]
    response["x-hypnos-previous-tier"] = telemetry["previous_tier"]
    response["x-hypnos-gpu-layers"] = str(telemetry["placement"]["gpu_layers"])
    response["x-hypnos-switch-ms"] = str(telemetry["tier_switch_latency_ms"])
    response["x-hypnos-inference-ms"] = str(telemetry["inference_latency_ms"])
    if "audio_secs" in engine:
        response["x-hypnos-audio-secs"] = str(engine["audio_secs"])
    if "rtf" in engine:
        response["x-hypnos-rtf"] = str(engine["rtf"])


async def _audio_events(call: InferenceCall) -> AsyncIterator[str]:
    """OpenAI's speech SSE: speech.audio.delta events (base64 audio, in response_format as the
    byte stream would carry it), then speech.audio.done; a failure mid-stream is an error event."""
    async with call:
        try:
            async for event in call.events():
                if isinstance(event, AudioChunk):
                    yield sse_data({"type": "speech.audio.delta", "audio": base64.b64encode(event.data).decode()})
                elif isinstance(event, Done):
                    made = event.result
                    assert isinstance(made, SpeechMade)
                    done = {"type": "speech.audio.done", "audio_secs": made.audio_secs, "samples": made.samples}
                    yield sse_data(done | {"hypnos_telemetry": event.telemetry})
        except HypnosError as exc:
            yield sse_data({"type": "error", "error": error_fields(exc)})


async def _audio_stream(call: InferenceCall) -> AsyncIterator[bytes]:
    """The audio as the worker sends it. A failure mid-stream ends the body early (spec §10;
    InferenceCall.events notes the error in the call's record); closing the connection aborts synthesis at the next
    phrase."""
    async with call:
        try:
            async for event in call.events():
                if isinstance(event, AudioChunk):
                    yield event.data
        except HypnosError:
            return
