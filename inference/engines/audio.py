"""Audio in and out for the speech engines: decoding uploads, phrase chunking, resampling and the
speech output formats, all through PyAV (FFmpeg's decoders, libswresample, and its encoders:
LAME for MP3, libopus in Ogg, FFmpeg's native AAC and FLAC). Imported by the worker only."""

from __future__ import annotations

import io
import math
import re
import struct
from collections.abc import Iterator

import av
import numpy as np

from hypnos_site.errors import InvalidRequest

#: Speech comes out at this rate whatever the voice's own (spec §10: mono, 24 kHz).
OUTPUT_RATE = 24_000
#: What Whisper listens at.
TRANSCRIBE_RATE = 16_000
PHRASE_SILENCE_SECS = 0.180
# A phrase longer than this is split again at commas, then at spaces.
MAX_PHRASE_CHARS = 300
# A streamed WAV declares an open-ended length (spec §10).
OPEN_ENDED = 0xFFFFFFFF

# response_format -> (container, codec, Content-Type); wav and pcm are written by hand.
ENCODED_FORMATS = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", **{k: v[2] for k, v in ENCODED_FORMATS.items()}}
SPEECH_FORMATS = tuple(CONTENT_TYPES)
_BIT_RATES = {"mp3": 64_000, "opus": 48_000, "aac": 64_000}


def decode_audio(
    data: bytes, rate: int = TRANSCRIBE_RATE, *, max_secs: float | None = None, param: str = "file"
) -> np.ndarray:
    """Any container FFmpeg reads, as mono float32 samples at `rate`. Audio that cannot be
    decoded (not audio, truncated, no audio stream) is a 400 naming the reason and `param`.

    Audio longer than `max_secs` is a 400 too: refused from the duration the container declares
    when it declares one, and in any case as soon as decoding passes the cap (a file whose
    header lies is never decoded further than that)."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
    cap = None if max_secs is None else math.ceil(max_secs * rate) + rate // 100  # 10 ms for resampler rounding
    pieces: list[np.ndarray] = []
    decoded = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise InvalidRequest("The file holds no audio stream.", param=param)
            declared = declared_secs(container)
            if max_secs is not None and declared is not None and declared > max_secs:
                raise too_long(declared, max_secs, param)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    decoded += pieces[-1].size
                if cap is not None and decoded > cap:
                    raise too_long(None, max_secs or 0, param)
            pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise InvalidRequest(f"The audio could not be decoded: {exc}", param=param) from exc
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
    if not samples.size:
        raise InvalidRequest("The audio could not be decoded: it holds no samples.", param=param)
    return samples.astype(np.float32) / 32768.0


def declared_secs(container: av.container.InputContainer) -> float | None:
    """The duration the container (or else its first audio stream) declares, or None."""
    if container.duration:
        return container.duration / av.time_base
    stream = container.streams.audio[0]
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return None


def too_long(declared: float | None, max_secs: float, param: str) -> InvalidRequest:
    length = f"is {declared:.1f} s long" if declared is not None else f"decodes to more than {max_secs:g} s"
    return InvalidRequest(f"The audio {length}, above limits.max_audio_secs ({max_secs:g} s).", param=param)


def phrases(text: str) -> list[str]:
    """The input cut where a speaker pauses: sentence ends, semicolons, colons, line breaks;
    a phrase too long for one breath is cut again at commas, then between words."""
    pieces = [p.strip() for p in re.split(r"(?<=[.!?;:])\s+|\n+", text)]
    out: list[str] = []
    for piece in filter(None, pieces):
        out += _split_long(piece)
    return out


def _split_long(piece: str) -> list[str]:
    if len(piece) <= MAX_PHRASE_CHARS:
        return [piece]
    parts, current = [], ""
    for word in re.split(r"(?<=,)\s+|\s+", piece):
        if current and len(current) + 1 + len(word) > MAX_PHRASE_CHARS:
            parts.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return parts + [current] if current else parts


def to_output_rate(samples: np.ndarray, rate: int) -> np.ndarray:
    """Float samples in [-1, 1] at `rate` as int16 at OUTPUT_RATE (libswresample)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype(np.int16)
    if rate == OUTPUT_RATE or not pcm.size:
        return pcm
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="s16", layout="mono", rate=OUTPUT_RATE)
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(out) if out else np.zeros(0, np.int16)


def silence() -> np.ndarray:
    return np.zeros(round(PHRASE_SILENCE_SECS * OUTPUT_RATE), np.int16)


def wav_header(n_samples: int | None) -> bytes:
    """A 16-bit mono WAV header at OUTPUT_RATE; None declares an open-ended stream."""
    data = OPEN_ENDED if n_samples is None else n_samples * 2
    riff = OPEN_ENDED if n_samples is None else 36 + data
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, OUTPUT_RATE, OUTPUT_RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


# MPEG-2 Layer III (24 kHz) frames hold 576 samples. FFmpeg's decoder trims the encoder padding the
# LAME header declares only as far as 47 samples into the last frame: an answer that ends 1 to 46
# samples into a frame decodes 47 - (n % 576) samples long. Measured over every length.
MP3_FRAME = 576
MP3_SHORTEST_TAIL = 47


def mp3_aligned(pcm: np.ndarray) -> np.ndarray:
    """`pcm` with at most 46 samples (2 ms) of silence appended where FFmpeg's decoder would
    otherwise return more samples than the MP3 holds, so every decoder returns exactly these."""
    tail = len(pcm) % MP3_FRAME
    if 0 < tail < MP3_SHORTEST_TAIL:
        return np.concatenate([pcm, np.zeros(MP3_SHORTEST_TAIL - tail, pcm.dtype)])
    return pcm


def encode(pcm: np.ndarray, response_format: str) -> bytes:
    """The whole answer in `response_format`."""
    if response_format == "pcm":
        return pcm.astype("<i2").tobytes()
    if response_format == "wav":
        return wav_header(len(pcm)) + pcm.astype("<i2").tobytes()
    container_name, codec, _ = ENCODED_FORMATS[response_format]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_name) as container:
        stream = container.add_stream(codec, rate=OUTPUT_RATE, layout="mono")
        assert isinstance(stream, av.AudioStream)  # every ENCODED_FORMATS codec is an audio codec
        if response_format in _BIT_RATES:
            stream.bit_rate = _BIT_RATES[response_format]
        frame = av.AudioFrame.from_ndarray(pcm.astype(np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = OUTPUT_RATE
        frame.pts = 0
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    """`data` in pieces of at most `size` bytes (the channel layer caps a message near 1 MB)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]
