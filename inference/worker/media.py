"""The worker's media operations: embeddings, transcription and speech.

They run on the chat path's machinery (admission, the model's slot, a lease, `ensure_tier1`,
eviction, telemetry); this module holds what differs: the work each op carries, how it drives
its engine, and the events it sends back (inference/transport/wire.py). Vectors and audio go as bytes in
events of bounded size (the channel layer caps a message near 1 MB), and a large upload comes as
a spool file path instead of inline bytes."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, DeviceOutOfMemory, InvalidRequest
from inference.transport.transcripts import Transcript
from inference.transport.wire import (
    AudioChunk,
    Done,
    Embedded,
    EmbedWork,
    MediaResult,
    SpeechMade,
    SpeechWork,
    Started,
    TranscribeWork,
    VectorChunk,
)

if TYPE_CHECKING:
    from inference.engines.base import Engine
    from inference.worker.runtime import ModelRuntime
    from inference.worker.tier_moves import TierMoves

Event = Any  # an inference.transport.wire event
MEDIA_OPS = {"embed": "embeddings", "transcribe": "speech_to_text", "speech": "text_to_speech"}
ROUTES = {"embed": "/v1/embeddings", "transcribe": "/v1/audio/transcriptions", "speech": "/v1/audio/speech"}
VECTORS_PER_EVENT = 256  # 384 dims: ~0.5 MB of base64 per event
AUDIO_BYTES_PER_EVENT = 256 << 10
STREAMABLE_FORMATS = ("wav", "pcm")


@dataclass
class MediaWork:
    op: str
    payload: EmbedWork | TranscribeWork | SpeechWork


def media_work(config: ModelConfig, work: EmbedWork | TranscribeWork | SpeechWork) -> MediaWork:
    """The op's work, refused at admission when the model does not serve its modality."""
    op = work.kind
    if config.modality != MEDIA_OPS[op]:
        message = f"The model {config.id!r} serves {config.modality}, not {MEDIA_OPS[op]} ({ROUTES[op]})."
        if op == "transcribe" and config.speech_to_text_model:
            # Its modalities list speech_to_text: it hears a chat's audio parts through another model.
            message += (
                f" It hears the audio parts of a chat through {config.speech_to_text_model!r}; "
                f"send a transcription to that model."
            )
        raise InvalidRequest(message, param="model")
    return MediaWork(op, work)


def serve_media(
    moves: TierMoves,
    runtime: ModelRuntime,
    engine: Engine,
    work: MediaWork,
    cancel: threading.Event,
    sink: Any,
    queue_ms: float,
) -> Event:
    """Bring the model to tier 1, run the op, and return the terminal `done` event with the
    spec's telemetry (§5); intermediate events (vectors, audio) go to `sink` as they come."""
    switch = moves.ensure_tier1(runtime, runtime.config.context_len)
    placement = moves.tiers.placement(runtime.config.id)
    if isinstance(work.payload, SpeechWork):
        # Refused before `started` when the voice cannot speak it (a 400, streamed or not).
        language = engine.speech_language(work.payload.voice, work.payload.language)
        work = MediaWork(work.op, work.payload.model_copy(update={"language": language}))
    sink(
        Started(
            previous_tier=str(switch.previous_tier), gpu_layers=placement.gpu_layers, tier_switch_ms=switch.switch_ms
        )
    )
    # The payload's type matches the op (media_work built it from the request).
    ops: dict[str, Callable[[Engine, Any, threading.Event, Any], tuple[MediaResult, dict[str, float]]]] = {
        "embed": _embed,
        "transcribe": _transcribe,
        "speech": _speech,
    }
    run = ops[work.op]
    started = time.perf_counter()
    try:
        result, timings = run(engine, work.payload, cancel, sink)
    except DeviceOutOfMemory:
        if work.op != "embed":
            raise
        # Spec §4: evict the idle models and retry once (embeddings are not streamed).
        switch.evicted += moves.evict_idle(runtime.config.id, "device_out_of_memory")
        result, timings = run(engine, work.payload, cancel, sink)
    inference_ms = (time.perf_counter() - started) * 1000
    if "audio_secs" in timings and timings["audio_secs"] > 0:
        timings["rtf"] = round(inference_ms / 1000 / timings["audio_secs"], 4)
    telemetry = switch.telemetry(placement, inference_ms, {"queue_ms": round(queue_ms, 1), **timings})
    if switch.phases and runtime.config.engine == "ggml_llama":
        telemetry["tier_switch_phases"] = switch.phases.as_dict()
    return Done(result=result, telemetry=telemetry)


def _embed(engine: Engine, payload: EmbedWork, cancel: threading.Event, sink: Any) -> tuple[Embedded, dict[str, float]]:
    vectors, tokens = engine.embed(payload.input, cancel)
    for start in range(0, len(vectors), VECTORS_PER_EVENT):
        batch = vectors[start : start + VECTORS_PER_EVENT]
        sink(VectorChunk(data=[v.astype("<f4").tobytes() for v in batch]))
    return Embedded(prompt_tokens=tokens), {}


def audio_bytes(payload: TranscribeWork) -> bytes:
    """The upload: inline base64, or a spool file the web process wrote (removed once read)."""
    if payload.audio_path:
        path = Path(payload.audio_path)
        try:
            return path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
    return base64.b64decode(payload.audio or "")


def _transcribe(
    engine: Engine, payload: TranscribeWork, cancel: threading.Event, sink: Any
) -> tuple[Transcript, dict[str, float]]:
    from inference.engines.audio import decode_audio
    from inference.engines.base import TranscribeOptions

    # The web process sends its limits.max_audio_secs and the request's field for the audio.
    samples = decode_audio(audio_bytes(payload), max_secs=payload.max_audio_secs, param=payload.audio_param)
    options = TranscribeOptions(
        language=payload.language,
        prompt=payload.prompt,
        temperature=payload.temperature or 0.0,
        word_timestamps=payload.word_timestamps,
    )
    transcript = engine.transcribe(samples, options, cancel)
    return transcript, {"audio_secs": transcript.duration_secs}


def _speech(
    engine: Engine, payload: SpeechWork, cancel: threading.Event, sink: Any
) -> tuple[SpeechMade, dict[str, float]]:
    """Phrase by phrase, 180 ms of silence between phrases, at 24 kHz. wav and pcm streams send
    each phrase as it is ready (wav behind an open-ended header); anything else is encoded once
    the whole answer exists, then sent."""
    from inference.engines import audio

    fmt = payload.response_format
    streaming = payload.stream and fmt in STREAMABLE_FORMATS
    started = time.perf_counter()
    first_audio_ms: float | None = None
    kept: list[np.ndarray] = []
    total = 0

    def send(data: bytes) -> None:
        for piece in audio.pieces(data, AUDIO_BYTES_PER_EVENT):
            sink(AudioChunk(data=bytes(piece)))

    if streaming and fmt == "wav":
        send(audio.wav_header(None))
    for index, phrase in enumerate(audio.phrases(payload.input)):
        if cancel.is_set():
            raise Cancelled("the request was cancelled")
        assert payload.language is not None  # serve_media resolved it
        samples, rate = engine.synthesize(phrase, payload.voice, payload.speed, payload.language)
        pcm = audio.to_output_rate(samples, rate)
        if index:
            pcm = np.concatenate([audio.silence(), pcm])
        total += len(pcm)
        if first_audio_ms is None:
            first_audio_ms = (time.perf_counter() - started) * 1000
        if streaming:
            send(pcm.astype("<i2").tobytes())
        else:
            kept.append(pcm)
    if not streaming:
        whole = np.concatenate(kept) if kept else np.zeros(0, np.int16)
        if fmt == "mp3":
            whole = audio.mp3_aligned(whole)
            total = len(whole)
        send(audio.encode(whole, fmt))
    audio_secs = round(total / audio.OUTPUT_RATE, 3)
    timings = {"audio_secs": audio_secs, "ttfa_ms": round(first_audio_ms or 0.0, 1)}
    return SpeechMade(audio_secs=audio_secs, samples=total, sample_rate=audio.OUTPUT_RATE), timings
