"""Speech (Piper joe, onnxruntime) and transcription (Whisper tiny.en, faster-whisper) through the
views and the in-process worker, with real models, real encoders and real decoders (PyAV)."""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Iterator

import av
import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from inference.worker import Worker
from tests.integration.conftest import post_json, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
TTS, STT = "piper-joe", "whisper-tiny.en"
# Piper samples its phoneme durations, so every synthesis differs a little; this sentence came
# back exactly from Whisper tiny.en in 27 of 27 trials (the fox sentence only in 10 of 12).
SENTENCE = "Hello world. The weather is nice today."
# About 12 s of varied speech (repeating one sentence makes Whisper's repetition guard kick in).
PARAGRAPH = (
    "Good morning. The weather is nice today. The cat sat on the mat. Please send the report to the "
    "office before noon. We will meet again next week. The train leaves at seven in the evening. "
    "Thank you for listening."
)
WORDS = "hello world the weather is nice today"


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


async def speak(api, text: str = SENTENCE, **extra) -> object:
    response = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": text, **extra})
    assert response.status_code == 200, response.content
    return response


async def transcribe(api, audio: bytes, **fields) -> object:
    form = {"model": STT, "file": SimpleUploadedFile("speech.wav", audio, "audio/wav"), **fields}
    return await api.post("/v1/audio/transcriptions", form)


def decoded_samples(data: bytes) -> tuple[int, int]:
    """Samples and rate as FFmpeg's decoder gives them."""
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames), frames[0].sample_rate


def wav_samples(data: bytes) -> np.ndarray:
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    return np.frombuffer(data[44:], dtype="<i2")


@pytest.fixture(scope="module")
def spoken_wav() -> Iterator[dict]:
    """One synthesized clip shared by the transcription tests (filled by the first test)."""
    yield {}


async def test_speech_then_transcription_gives_the_sentence_back(api, spoken_wav):
    # Piper samples its phoneme durations, so each synthesis differs a little, and Whisper tiny.en
    # mishears a word in a few percent of them: one fresh synthesis is allowed.
    for _attempt in range(2):
        speech = await speak(api)
        assert speech["content-type"] == "audio/wav"
        response = await transcribe(api, speech.content)
        assert response.status_code == 200, response.content
        body = response.json()
        if words(body["text"]) == WORDS:
            break
    assert words(body["text"]) == WORDS
    spoken_wav["wav"] = speech.content
    assert body["duration_secs"] == pytest.approx(len(wav_samples(speech.content)) / 24000, abs=0.01)
    engine = body["hypnos_telemetry"]["engine"]
    assert engine["audio_secs"] == pytest.approx(body["duration_secs"]) and engine["rtf"] > 0


async def test_a_wav_is_16_bit_mono_24_khz_with_the_telemetry_headers(api):
    speech = await speak(api, "Good morning.")
    channels, rate, byte_rate, align, bits = struct.unpack("<HIIHH", speech.content[22:36])
    assert (channels, rate, byte_rate, align, bits) == (1, 24000, 48000, 2, 16)
    assert struct.unpack("<I", speech.content[40:44])[0] == len(speech.content) - 44
    samples = int(speech["x-hypnos-audio-samples"])
    assert len(wav_samples(speech.content)) == samples
    assert float(speech["x-hypnos-audio-secs"]) == pytest.approx(samples / 24000, abs=0.001)
    assert speech["x-hypnos-previous-tier"] in ("tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd")
    assert speech["x-hypnos-gpu-layers"] == "0"
    assert float(speech["x-hypnos-inference-ms"]) > 0 and float(speech["x-hypnos-rtf"]) > 0
    assert "x-hypnos-switch-ms" in speech


@pytest.mark.parametrize(
    "fmt, content_type, magic",
    [
        ("pcm", "audio/pcm", None),
        ("mp3", "audio/mpeg", b"ID3"),
        ("opus", "audio/ogg", b"OggS"),
        ("flac", "audio/flac", b"fLaC"),
        ("aac", "audio/aac", b"\xff\xf1"),
    ],
)
async def test_every_format_decodes_to_the_samples_the_server_made(api, fmt, content_type, magic):
    speech = await speak(api, "Good morning.", response_format=fmt)
    assert speech["content-type"] == content_type
    made = int(speech["x-hypnos-audio-samples"])
    if fmt == "pcm":
        assert len(speech.content) == 2 * made
        return
    assert speech.content.startswith(magic)
    count, rate = decoded_samples(speech.content)
    if fmt == "opus":  # Opus always decodes at 48 kHz: exactly twice the 24 kHz samples
        assert (count, rate) == (2 * made, 48000)
    elif fmt == "aac":  # ADTS carries no gapless info: 1024 samples of encoder delay, whole frames
        assert rate == 24000 and count == 1024 * (1 + -(-made // 1024))
    else:
        assert (count, rate) == (made, 24000)


async def test_a_stream_starts_with_an_open_ended_wav_header_and_transcribes_back(api):
    response = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": SENTENCE, "stream": True})
    assert response.status_code == 200 and response["content-type"] == "audio/wav"
    assert response["x-hypnos-previous-tier"] and "x-hypnos-switch-ms" in response
    assert "x-hypnos-rtf" not in response
    chunks = [chunk async for chunk in response.streaming_content]
    body = b"".join(chunks)
    assert body[4:8] == b"\xff\xff\xff\xff" and body[40:44] == b"\xff\xff\xff\xff"
    assert len(chunks) >= 3  # the header, then one chunk per phrase at least
    samples = np.frombuffer(body[44:], dtype="<i2")
    size = 2 * len(samples)
    fixed = body[:4] + struct.pack("<I", 36 + size) + body[8:40] + struct.pack("<I", size) + body[44:]
    heard = await transcribe(api, fixed)
    assert "nice today" in words(heard.json()["text"])


async def test_phrases_are_joined_by_180_ms_of_silence(api):
    speech = await speak(api, "First phrase here. Second phrase here.", response_format="pcm")
    samples = np.frombuffer(speech.content, dtype="<i2")
    silent = np.flatnonzero(np.diff(np.concatenate([[1], (samples == 0).astype(np.int8), [1]])))
    runs = silent[1::2] - silent[::2]
    assert runs.max() >= 4320  # 0.180 s at 24 kHz


async def test_speed_changes_the_length(api):
    slow = int((await speak(api, "Good morning.", speed=0.5))["x-hypnos-audio-samples"])
    normal = int((await speak(api, "Good morning.", speed=1.0))["x-hypnos-audio-samples"])
    fast = int((await speak(api, "Good morning.", speed=2.0))["x-hypnos-audio-samples"])
    # Piper samples its phoneme durations (noise_w) and rounds each up to whole frames, so the
    # 4x asked for comes out between about 2.4x and 4x; the order and a 2x margin always hold.
    assert fast < normal < slow
    assert fast * 2 < slow


async def test_an_unknown_speech_format_is_400(api):
    response = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": "Hi.", "response_format": "ogg"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


async def test_speech_on_a_chat_model_is_400(api):
    response = await post_json(api, "/v1/audio/speech", {"model": "smollm2-135m", "input": "Hi."})
    assert response.status_code == 400 and "text_to_speech" in response.json()["error"]["message"]
    assert "(/v1/audio/speech)" in response.json()["error"]["message"]


async def test_a_transcription_on_a_chat_model_is_400_naming_the_route_and_the_model_that_hears(api, spoken_wav):
    audio = spoken_wav.get("wav") or (await speak(api)).content
    form = {"model": "smollm2-135m", "file": SimpleUploadedFile("speech.wav", audio, "audio/wav")}
    response = await api.post("/v1/audio/transcriptions", form)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model"
    # Once it named /v1/transcriptions, a path that does not exist.
    assert "(/v1/audio/transcriptions)" in error["message"] and "/v1/transcriptions" not in error["message"]
    assert "'whisper-tiny.en'" in error["message"], error["message"]


async def test_the_transcription_formats(api, spoken_wav):
    audio = spoken_wav.get("wav") or (await speak(api)).content
    text = await transcribe(api, audio, response_format="text")
    assert text["content-type"].startswith("text/plain") and words(text.content.decode()).endswith("nice today")
    srt = (await transcribe(api, audio, response_format="srt")).content.decode()
    assert re.match(r"1\n00:00:00,000 --> 00:00:0\d,\d{3}\n", srt) and "today" in srt.lower()
    vtt = (await transcribe(api, audio, response_format="vtt")).content.decode()
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = (
        await transcribe(
            api, audio, response_format="verbose_json", **{"timestamp_granularities[]": ["word", "segment"]}
        )
    ).json()
    assert verbose["task"] == "transcribe" and verbose["language"] == "english"
    assert verbose["segments"][0]["start"] == 0.0 and verbose["segments"][-1]["end"] > 1.5
    assert [w["word"].strip(" ,.").lower() for w in verbose["words"]][-2:] == ["nice", "today"]
    assert verbose["words"][0]["start"] < verbose["words"][-1]["start"] < verbose["words"][-1]["end"]


async def test_json_audio_bytes_and_the_language_echo(api, spoken_wav):
    audio = spoken_wav.get("wav") or (await speak(api)).content
    response = await post_json(
        api,
        "/v1/audio/transcriptions",
        {"model": "whisper-1", "audio_bytes": list(audio), "language": "en", "temperature": 0},
    )
    assert response.status_code == 200, response.content
    assert words(response.json()["text"]).endswith("nice today") and response.json()["language"] == "en"


async def test_audio_that_cannot_be_decoded_is_a_clear_400(api):
    response = await transcribe(api, b"this is not audio at all, just some text " * 20)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "file" and "could not be decoded" in error["message"]


async def test_audio_above_max_audio_bytes_is_400(api, settings, spoken_wav):
    with_limits(settings, max_audio_bytes=1000)
    response = await transcribe(api, b"\0" * 2000)
    assert response.status_code == 400 and "max_audio_bytes" in response.json()["error"]["message"]


async def test_another_language_on_an_english_model_is_400(api, spoken_wav):
    audio = spoken_wav.get("wav") or (await speak(api)).content
    response = await transcribe(api, audio, language="it")
    assert response.status_code == 400 and response.json()["error"]["param"] == "language"


async def test_a_large_upload_travels_through_the_spool(api, settings):
    """Above 512 KiB the audio reaches the worker as a spool file, removed once read."""
    speech = await speak(api, PARAGRAPH)
    wav = speech.content
    assert len(wav) > 512 << 10
    response = await transcribe(api, wav)
    assert response.status_code == 200
    heard = words(response.json()["text"])
    assert all(phrase in heard for phrase in ("nice today", "report", "next week", "thank you"))
    spool = settings.HYPNOS.data_dir / "spool"
    assert not list(spool.glob("*.audio"))


def two_voice_config(config, budget: int):
    models = [m.model_copy(update={"initial_tier": "tier3_nvme_ssd"}) for m in config.models if m.id in (TTS, STT)]
    return config.model_copy(
        update={
            "hardware": config.hardware.model_copy(update={"simulated_vram_bytes": budget}),
            "models": models,
        }
    )


@pytest.fixture
def tight(settings, serve) -> Worker:
    # Whisper (~174 MB booked) and Piper (~223 MB) do not fit 300 MB together.
    return serve(two_voice_config(settings.HYPNOS, 300_000_000))


async def test_speech_and_transcription_evict_each_other_like_chat_models(api, tight):
    first = await speak(api, "Good morning.")
    assert first["x-hypnos-previous-tier"] == "tier3_nvme_ssd" and float(first["x-hypnos-switch-ms"]) > 0
    heard = await transcribe(api, first.content)
    assert heard.status_code == 200
    telemetry = heard.json()["hypnos_telemetry"]
    assert telemetry["previous_tier"] == "tier3_nvme_ssd" and telemetry["evicted_models"] == [TTS]
    again = await speak(api, "Good morning.")
    # Evicted warm: the voice comes back from tier 2 (its graph in a memfd), not from disk.
    assert again["x-hypnos-previous-tier"] == "tier2_pinned_ram" and float(again["x-hypnos-switch-ms"]) > 0
    status = (await api.get("/v1/memory/status")).json()
    tiers = {m["id"]: m["current_tier"] for m in status["models"]}
    assert tiers == {TTS: "tier1_gpu_vram", STT: "tier2_pinned_ram"}
    assert [e["model"] for e in status["recent_evictions"]][:2] == [STT, TTS]  # newest first
