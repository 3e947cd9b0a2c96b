"""Issue 12, media slice: decoded-size caps on images and audio, NUL in speech input, through the
views and the in-process worker with the real engines (SmolLM2, Whisper tiny.en, Piper).

Each test is one finding: the crafted file is made here (a PNG header declaring 13000x13000
pixels, an hour of FLAC silence, a FLAC whose header understates its length), the answer is the
spec's 400 envelope naming the field, it comes at once, and the process does not grow by the
gigabytes the decode would have taken."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib

import av
import numpy as np
import psutil
import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.core.files.uploadedfile import SimpleUploadedFile
from PIL import Image

from hypnos_site.errors import InvalidRequest
from inference.web.openai.realtime import RATE, websocket_urlpatterns
from inference.worker import Worker
from memory.gguf import read_gguf
from tests.integration.conftest import post_json, with_limits
from tests.integration.test_vision import write_tiny_projector

pytestmark = pytest.mark.django_db(transaction=True)
CHAT, STT, TTS, SEEING = "smollm2-135m", "whisper-tiny.en", "piper-joe", "smollm2-seeing"
# What the decodes of the findings took: 2.2 GB (the PNG), 3.25 GB (the FLAC). A refusal must
# leave the process far below that.
MAX_GROWTH_BYTES = 150 << 20
# "At once": a refusal reads a header, not the file (the findings took 6 s and 47 s; a refusal
# takes under 0.5 s on an idle machine, 10x that leaves room for a busy one).
QUICK_SECS = 5.0


def png_bomb(width: int = 13000, height: int = 13000) -> bytes:
    """A real PNG of `width` x `height` 8-bit grey pixels, all black: ~20 KB that decode to
    width x height bytes (x3 as RGB). Compressed row by row, so making it takes no memory."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte 0, then the row
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def flac_silence(secs: float, rate: int = 8000, declared_secs: float | None = None) -> bytes:
    """`secs` of silence as FLAC (an hour is ~656 KB and takes PyAV under a second); with
    `declared_secs` the STREAMINFO header says that length instead of the real one."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        block = np.zeros((1, rate), np.int16)  # one second a frame
        for index in range(round(secs)):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, index * block.shape[1]
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    data = bytearray(buffer.getvalue())
    if declared_secs is not None:
        # STREAMINFO follows "fLaC" and its 4-byte block header; bytes 10-17 hold the sample
        # rate (20 bits), channels and bits per sample (8 bits) and the total samples (36 bits).
        fields = int.from_bytes(data[18:26], "big")
        fields = (fields & ~((1 << 36) - 1)) | round(declared_secs * rate)
        data[18:26] = fields.to_bytes(8, "big")
    return bytes(data)


def wav_silence(secs: float, rate: int = 16000) -> bytes:
    pcm = bytes(int(secs * rate) * 2)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(pcm))
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", len(pcm))
        + pcm
    )


@pytest.fixture(scope="module")
def hour_of_flac() -> bytes:
    return flac_silence(3600)


def rss() -> int:
    return psutil.Process().memory_info().rss


def assert_invalid(response, param: str, message: str) -> None:
    """The spec's 400 envelope, exactly, with a request id."""
    assert response.status_code == 400, response.content
    assert response["x-request-id"].startswith("req-")
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_request_error"}
    }


async def transcribe(api, audio: bytes, name: str = "clip.flac"):
    return await api.post("/v1/audio/transcriptions", {"model": STT, "file": SimpleUploadedFile(name, audio)})


def audio_chat(audio: bytes, fmt: str = "flac") -> dict:
    return {
        "model": CHAT,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is said here?"},
                    {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": fmt}},
                ],
            }
        ],
    }


# -- images --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    from django.conf import settings

    weights = settings.HYPNOS.weights_file(next(m for m in settings.HYPNOS.models if m.id == CHAT))
    path = tmp_path_factory.mktemp("vision") / "tiny-mmproj.gguf"
    write_tiny_projector(path, int(read_gguf(weights).metadata["llama.embedding_length"]))
    return path


@pytest.fixture
def seeing(settings, serve, projector) -> Worker:
    """SmolLM2 with test_vision.py's tiny projector: a model that takes image_url parts."""
    smol = next(m for m in settings.HYPNOS.models if m.id == CHAT)
    seeing = smol.model_copy(
        update={"id": SEEING, "aliases": [], "aux_path": str(projector), "speech_to_text_model": None}
    )
    settings.HYPNOS = settings.HYPNOS.model_copy(update={"models": [seeing]})
    return serve(settings.HYPNOS)


def image_chat(data: bytes) -> dict:
    return {
        "model": SEEING,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe it."},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
                    },
                ],
            }
        ],
    }


async def test_it_refuses_a_png_declaring_13000x13000_pixels_before_the_worker(api, seeing):
    bomb = png_bomb()
    assert len(bomb) < 300 << 10  # a small upload that would decode to 169 M pixels
    body = image_chat(bomb)
    before, started = rss(), time.perf_counter()
    response = await post_json(api, "/v1/chat/completions", body)
    elapsed = time.perf_counter() - started
    assert_invalid(
        response, "messages", "An image declares more pixels than limits.max_image_pixels allows (16777216)."
    )
    assert elapsed < QUICK_SECS, elapsed
    assert rss() - before < MAX_GROWTH_BYTES


async def test_it_refuses_an_image_just_above_max_image_pixels_by_its_header(api, seeing, settings):
    with_limits(settings, max_image_pixels=64 * 64)

    def png(size: tuple[int, int]) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", size, (200, 30, 30)).save(out, format="PNG")
        return out.getvalue()

    response = await post_json(api, "/v1/chat/completions", image_chat(png((65, 64))))
    assert_invalid(response, "messages", "An image is 65x64 pixels, above limits.max_image_pixels (4096).")
    assert (await post_json(api, "/v1/chat/completions", image_chat(png((64, 64))))).status_code == 200


def test_the_worker_decodes_no_image_above_max_image_pixels(worker):
    # The worker's own check (inference/engines/vision.py), for a path that skipped the web's:
    # Image.MAX_IMAGE_PIXELS comes from limits.max_image_pixels at start-up.
    from inference.engines.vision import decode_rgb

    assert Image.MAX_IMAGE_PIXELS == 16777216
    above, bomb = png_bomb(4097, 4096), png_bomb()  # made before the clock starts
    before, started = rss(), time.perf_counter()
    with pytest.raises(InvalidRequest) as caught:
        decode_rgb(above, 0)
    assert caught.value.param == "messages"
    assert caught.value.message == (
        "image 1 of the request is 4097x4096 pixels, above limits.max_image_pixels (16777216)."
    )
    with pytest.raises(InvalidRequest, match="image 2 of the request cannot be decoded"):
        decode_rgb(bomb, 1)
    assert time.perf_counter() - started < QUICK_SECS
    assert rss() - before < MAX_GROWTH_BYTES
    assert decode_rgb(png_bomb(64, 64), 0).size == (64, 64)


# -- audio ---------------------------------------------------------------------------------


async def test_it_refuses_an_hour_of_flac_from_its_header(api, hour_of_flac):
    assert len(hour_of_flac) < 1 << 20  # ~656 KB: under every byte limit
    before, started = rss(), time.perf_counter()
    response = await transcribe(api, hour_of_flac)
    elapsed = time.perf_counter() - started
    assert_invalid(response, "file", "The audio is 3600.0 s long, above limits.max_audio_secs (1800 s).")
    assert elapsed < QUICK_SECS, elapsed
    assert rss() - before < MAX_GROWTH_BYTES


async def test_a_short_transcription_does_not_wait_behind_an_hour_of_flac(api, hour_of_flac):
    # The finding: a 2 s clip queued behind the hour waited 12 s. The hour never reaches the model now.
    long, short = await asyncio.gather(transcribe(api, hour_of_flac), transcribe(api, wav_silence(2), "clip.wav"))
    assert long.status_code == 400, long.content
    assert short.status_code == 200, short.content
    assert short.json()["duration_secs"] == 2.0
    assert short.json()["hypnos_telemetry"]["engine"]["queue_ms"] < 5000  # 0 when idle


async def test_it_stops_decoding_a_flac_whose_header_understates_its_length(api, settings):
    # The header says 1 s, the frames hold 60 s: the web's header check passes it, the worker's
    # decode stops at the cap instead of decoding the whole file.
    with_limits(settings, max_audio_secs=5)
    liar = flac_silence(60, declared_secs=1)
    with av.open(io.BytesIO(liar)) as container:
        assert container.duration / av.time_base == 1.0
    response = await transcribe(api, liar)
    assert_invalid(response, "file", "The audio decodes to more than 5 s, above limits.max_audio_secs (5 s).")
    # Within the cap, the same kind of file is transcribed.
    assert (await transcribe(api, flac_silence(4, declared_secs=1))).status_code == 200


async def test_it_refuses_an_hour_of_flac_in_an_input_audio_part(api, hour_of_flac):
    before, started = rss(), time.perf_counter()
    response = await post_json(api, "/v1/chat/completions", audio_chat(hour_of_flac))
    assert_invalid(response, "messages", "The audio is 3600.0 s long, above limits.max_audio_secs (1800 s).")
    assert time.perf_counter() - started < QUICK_SECS
    assert rss() - before < MAX_GROWTH_BYTES


async def test_it_stops_decoding_an_input_audio_part_whose_header_understates_its_length(api, settings):
    with_limits(settings, max_audio_secs=5)
    response = await post_json(api, "/v1/chat/completions", audio_chat(flac_silence(60, declared_secs=1)))
    assert_invalid(response, "messages", "The audio decodes to more than 5 s, above limits.max_audio_secs (5 s).")


async def test_the_realtime_buffer_is_capped_by_max_audio_secs(api, settings):
    with_limits(settings, max_audio_secs=1)
    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/v1/realtime?intent=transcription")
    assert (await communicator.connect())[0]
    assert (await communicator.receive_json_from(10))["type"] == "transcription_session.created"
    await communicator.send_json_to({"type": "transcription_session.update", "session": {"turn_detection": None}})
    assert (await communicator.receive_json_from(10))["type"] == "transcription_session.updated"
    second = base64.b64encode(bytes(RATE * 2)).decode()  # 1 s of pcm16 silence
    await communicator.send_json_to({"type": "input_audio_buffer.append", "audio": second})
    await communicator.send_json_to(
        {"type": "input_audio_buffer.append", "audio": second[:400], "event_id": "event_over"}
    )
    event = await communicator.receive_json_from(10)
    assert event["type"] == "error"
    assert event["error"] == {
        "type": "invalid_request_error",
        "code": "buffer_too_large",
        "param": "audio",
        "event_id": "event_over",
        "message": "The input audio buffer would exceed limits.max_audio_secs (1 s); commit or clear it.",
    }
    # The second within the cap stays and commits.
    await communicator.send_json_to({"type": "input_audio_buffer.commit"})
    assert (await communicator.receive_json_from(10))["type"] == "input_audio_buffer.committed"
    await communicator.disconnect()


# -- speech --------------------------------------------------------------------------------


async def test_it_refuses_a_nul_in_speech_input(api):
    response = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": "a\u0000b"})
    assert_invalid(
        response,
        "input",
        "Invalid value for input: Value error, must not contain NUL characters (U+0000; the first at index 1)",
    )
    # The same text without it is spoken.
    spoken = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": "a b"})
    assert spoken.status_code == 200 and spoken["content-type"] == "audio/wav"
