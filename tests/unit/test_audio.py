"""Phrase chunking, the WAV header, subtitle formats and the codecs, without a model."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from hypnos_site.errors import InvalidRequest
from inference.engines import audio
from inference.transport.transcripts import Segment
from inference.web.openai.serving_audio import srt, vtt

TONE = (np.sin(np.arange(12_345) * 2 * np.pi * 440 / audio.OUTPUT_RATE) * 8000).astype(np.int16)


def test_phrases_cut_at_sentence_ends_and_line_breaks():
    assert audio.phrases("Hello there. How are you?\nFine; thanks: bye!  ") == [
        "Hello there.",
        "How are you?",
        "Fine;",
        "thanks:",
        "bye!",
    ]
    assert audio.phrases("   ") == []


def test_a_long_phrase_is_cut_between_words_below_the_limit():
    text = ", ".join(["word"] * 200)
    pieces = audio.phrases(text)
    assert len(pieces) > 1
    assert all(len(p) <= audio.MAX_PHRASE_CHARS for p in pieces)
    assert " ".join(pieces) == text


def test_the_silence_between_phrases_is_180_ms():
    assert len(audio.silence()) == 4320 and not audio.silence().any()


def test_a_streamed_wav_header_declares_an_open_ended_length():
    header = audio.wav_header(None)
    assert len(header) == 44
    assert struct.unpack("<I", header[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", header[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<HHIIHH", header[20:36]) == (1, 1, 24000, 48000, 2, 16)


def test_a_whole_wav_declares_its_length_and_reads_back_with_the_wave_module():
    import wave

    with wave.open(io.BytesIO(audio.encode(TONE, "wav"))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert np.array_equal(np.frombuffer(wav.readframes(wav.getnframes()), "<i2"), TONE)


@pytest.mark.parametrize("fmt, rate_factor", [("mp3", 1), ("opus", 2), ("flac", 1)])
def test_the_compressed_formats_decode_to_the_same_number_of_samples(fmt, rate_factor):
    with av.open(io.BytesIO(audio.encode(TONE, fmt))) as container:
        count = sum(frame.samples for frame in container.decode(audio=0))
    assert count == len(TONE) * rate_factor


def test_an_aligned_mp3_decodes_to_exactly_its_samples_whatever_its_length():
    for n in (11520, 11521, 11540, 11566, 11567, 11800):
        pcm = audio.mp3_aligned(TONE[:1].repeat(n))
        assert n <= len(pcm) <= n + 46
        with av.open(io.BytesIO(audio.encode(pcm, "mp3"))) as container:
            assert sum(frame.samples for frame in container.decode(audio=0)) == len(pcm), n


def test_aac_decodes_to_its_encoder_delay_plus_whole_frames():
    with av.open(io.BytesIO(audio.encode(TONE, "aac"))) as container:
        count = sum(frame.samples for frame in container.decode(audio=0))
    assert count == 1024 * (1 + -(-len(TONE) // 1024))


def test_flac_is_lossless():
    with av.open(io.BytesIO(audio.encode(TONE, "flac"))) as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert np.array_equal(decoded, TONE)


def test_resampling_keeps_the_duration():
    samples = np.zeros(22050, np.float32)
    assert abs(len(audio.to_output_rate(samples, 22050)) - 24000) <= 1


def test_decoding_returns_16_khz_mono_float():
    samples = audio.decode_audio(audio.encode(TONE, "wav"))
    assert samples.dtype == np.float32
    assert abs(len(samples) - len(TONE) * 16000 / 24000) <= 1


def test_bytes_that_are_not_audio_are_a_400():
    with pytest.raises(InvalidRequest) as caught:
        audio.decode_audio(b"definitely not audio" * 10)
    assert caught.value.param == "file" and "could not be decoded" in caught.value.message


def test_srt_and_vtt_from_segments():
    timed = {"seek": 0, "tokens": [], "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 1.0}
    segments = [
        Segment(id=0, start=0.0, end=1.5, text=" Hello.", no_speech_prob=0.0, **timed),
        Segment(id=1, start=61.25, end=3725.004, text=" Bye.", no_speech_prob=0.0, **timed),
    ]
    assert srt(segments) == "1\n00:00:00,000 --> 00:00:01,500\nHello.\n\n2\n00:01:01,250 --> 01:02:05,004\nBye.\n\n"
    assert vtt(segments) == "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello.\n\n00:01:01.250 --> 01:02:05.004\nBye.\n\n"
