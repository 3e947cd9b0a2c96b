"""The official `openai` SDK's audio calls, unchanged, against both deployments over real
sockets: Piper speech in every format, Whisper transcriptions of it."""

from __future__ import annotations

import io
import re

import av
import openai
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
SENTENCE = "Hello world. The weather is nice today."
# About 12 s of varied speech (repeating one sentence makes Whisper's repetition guard kick in).
PARAGRAPH = (
    "Good morning. The weather is nice today. The cat sat on the mat. Please send the report to the "
    "office before noon. We will meet again next week. The train leaves at seven in the evening. "
    "Thank you for listening."
)
WORDS = "hello world the weather is nice today"


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def test_speech_create_then_transcriptions_create_give_the_sentence_back(server):
    client = sdk(server)
    # Piper samples its phoneme durations, so each synthesis differs a little, and Whisper tiny.en
    # mishears a word in a few percent of them: one fresh synthesis is allowed.
    for _attempt in range(2):
        raw = client.audio.speech.with_raw_response.create(
            model="tts-1", voice="alloy", input=SENTENCE, response_format="wav"
        )
        assert raw.headers["content-type"] == "audio/wav"
        assert float(raw.headers["x-hypnos-audio-secs"]) > 1 and float(raw.headers["x-hypnos-rtf"]) > 0
        transcript = client.audio.transcriptions.create(
            model="whisper-1", file=("speech.wav", raw.content, "audio/wav")
        )
        if words(transcript.text) == WORDS:
            break
    assert words(transcript.text) == WORDS
    assert transcript.model_extra["hypnos_telemetry"]["engine"]["audio_secs"] > 1


def test_the_sdk_gets_mp3_and_verbose_json(server):
    client = sdk(server)
    mp3 = client.audio.speech.create(model="piper-joe", voice="nova", input=SENTENCE, response_format="mp3").content
    assert mp3[:3] == b"ID3"
    with av.open(io.BytesIO(mp3)) as container:
        assert container.format.name == "mp3" and container.streams.audio[0].codec_context.name.startswith("mp3")
    verbose = client.audio.transcriptions.create(
        model="whisper-tiny.en",
        file=("speech.mp3", mp3, "audio/mpeg"),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert words(verbose.text).endswith("nice today")
    assert verbose.language == "english" and verbose.duration > 1
    assert [w.word.strip(" ,.").lower() for w in verbose.words][-2:] == ["nice", "today"]
    srt = client.audio.transcriptions.create(model="whisper-1", file=("speech.mp3", mp3), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ")


def test_a_large_upload_reaches_the_worker_through_the_spool(server):
    client = sdk(server)
    wav = client.audio.speech.create(model="tts-1", voice="alloy", input=PARAGRAPH, response_format="wav").content
    assert len(wav) > 512 << 10  # above what travels inline in a channel message
    transcript = client.audio.transcriptions.create(model="whisper-1", file=("long.wav", wav), response_format="text")
    heard = words(transcript)
    assert all(phrase in heard for phrase in ("nice today", "report", "next week", "thank you"))


def test_undecodable_audio_is_the_sdks_bad_request(server):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).audio.transcriptions.create(model="whisper-1", file=("x.wav", b"not audio" * 50))
    assert "could not be decoded" in caught.value.body["message"]
