"""The Batch API (POST/GET /v1/batches, GET /v1/batches/{id}, POST .../cancel) on the embedded
deployment: real models answer every line through the server's own routes (transcriptions too,
their audio a file of the key or a data: URL), the output and error files come back in input
order, a bad line refuses the batch naming it, a cancel stops it between lines, a batch past its
completion window expires, a job started again does nothing twice, a batch never takes the room
of a model interactive traffic leases, and the keys' rights and quotas hold."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import AsyncClient
from django.test.client import encode_multipart
from django.utils import timezone

from hypnos_site.config import HypnosConfig, KeyConfig
from inference.jobs import batches as batch_job
from inference.transport.runtime import get_client
from inference.worker import Worker
from logs import batches
from logs.models import Batch
from models_registry.authentication import ApiPrincipal, default_label
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, wait_until, with_server

pytestmark = pytest.mark.django_db(transaction=True)
ADMIN = "sk-admin-test"
SMOL = "smollm2-135m"
QWEN = "qwen2.5-coder-0.5b"
EMBED = "all-minilm-l6-v2"
TTS, STT = "piper-joe", "whisper-tiny.en"
# Whisper tiny.en gives this Piper sentence back word for word (tests/integration/test_audio.py).
SENTENCE = "Hello world. The weather is nice today."
BOUNDARY = "hypnos-batch-boundary"
# Each wait polls the batch; an idle machine finishes these batches in seconds.
WAIT_SECS = 240


@pytest.fixture(autouse=True)
def keys(settings: Any, tmp_path: Path) -> None:
    with_server(
        settings,
        data_dir=str(tmp_path),
        api_keys=[ADMIN],
        keys=[
            KeyConfig(key="sk-a", label="team-a"),
            KeyConfig(key="sk-b", label="team-b"),
            KeyConfig(key="sk-daily", label="daily", tokens_per_day=40),
        ],
    )


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat_line(custom_id: str, text: str, model: str = SMOL, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def embed_line(custom_id: str, text: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED, "input": text}}


def transcription_line(custom_id: str, audio: str, **fields: Any) -> dict[str, Any]:
    body = {"model": STT, "file": audio, "language": "en", **fields}
    return {"custom_id": custom_id, "method": "POST", "url": batches.TRANSCRIPTIONS, "body": body}


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


async def upload(api: AsyncClient, lines: list[Any], key: str = "sk-a") -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return await upload_bytes(api, content, "batch.jsonl", "batch", key)


async def upload_bytes(api: AsyncClient, content: bytes, filename: str, purpose: str, key: str = "sk-a") -> str:
    class Part:
        name = filename

        def read(self) -> bytes:
            return content

    response = await api.post(
        "/v1/files",
        data=encode_multipart(BOUNDARY, {"file": Part(), "purpose": purpose}),
        content_type=f"multipart/form-data; boundary={BOUNDARY}",
        headers=bearer(key),
    )
    assert response.status_code == 200, response.content
    return str(response.json()["id"])


async def create(api: AsyncClient, file_id: str, endpoint: str, key: str = "sk-a", **extra: Any) -> Any:
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    return await post_json(api, "/v1/batches", body, **bearer(key))


async def ended(api: AsyncClient, batch_id: str, key: str = "sk-a") -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECS
    while True:
        batch = (await api.get(f"/v1/batches/{batch_id}", headers=bearer(key))).json()
        if batch["status"] in batches.TERMINAL:
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)


async def lines_of(api: AsyncClient, file_id: str | None, key: str = "sk-a") -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = await api.get(f"/v1/files/{file_id}/content", headers=bearer(key))
    assert response.status_code == 200
    raw = b"".join([chunk async for chunk in response.streaming_content])
    return [json.loads(line) for line in raw.splitlines()]


async def test_a_chat_batch_answers_every_line_once_in_input_order(api):
    questions = ["What is the capital of France?", "Say hello.", "Name a colour.", "Count to three."]
    # The unknown model's line fails alone; the lines of the two models are grouped.
    lines = [chat_line(f"q{i}", text) for i, text in enumerate(questions)]
    lines.insert(2, chat_line("nope", "Hi", model="no-such-model"))
    file_id = await upload(api, lines)
    created = await create(api, file_id, "/v1/chat/completions", metadata={"run": "nightly"})
    assert created.status_code == 200, created.content
    batch = created.json()
    assert batch["object"] == "batch" and batch["status"] == "in_progress" and batch["metadata"] == {"run": "nightly"}
    assert batch["request_counts"]["total"] == 5
    done = await ended(api, batch["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    output = await lines_of(api, done["output_file_id"])
    assert [line["custom_id"] for line in output] == ["q0", "q1", "q2", "q3"]
    for line in output:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req-")
        assert response["body"]["object"] == "chat.completion" and response["body"]["choices"][0]["message"]["content"]
    # The same request made directly gets the same greedy answer.
    direct = await post_json(api, "/v1/chat/completions", lines[0]["body"], **bearer("sk-a"))
    first = output[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert direct.json()["choices"][0]["message"]["content"] == first
    [error] = await lines_of(api, done["error_file_id"])
    assert error["custom_id"] == "nope" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    # The results file of the run is gone; its lines went into the two files.
    assert not batches.results_path(batch["id"]).exists()
    page = (await api.get("/metrics")).content.decode()
    assert 'hypnos_batch_lines_total{status="completed"} 4.0' in page
    assert 'hypnos_batch_lines_total{status="failed"} 1.0' in page
    assert 'hypnos_batches{status="completed"} 1.0' in page and "hypnos_batch_queue_lines 0.0" in page


async def test_an_embeddings_batch_gives_the_vectors_of_single_calls(api):
    texts = [f"sentence number {i} about batches" for i in range(20)]
    file_id = await upload(api, [embed_line(f"e{i}", text) for i, text in enumerate(texts)])
    batch = (await create(api, file_id, "/v1/embeddings")).json()
    done = await ended(api, batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 20
    output = await lines_of(api, done["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"e{i}" for i in range(20)]
    single = await post_json(api, "/v1/embeddings", {"model": EMBED, "input": texts[7]}, **bearer("sk-a"))
    assert output[7]["response"]["body"]["data"][0]["embedding"] == single.json()["data"][0]["embedding"]
    assert done["error_file_id"] is None


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ({**chat_line("a", "Hi"), "url": "/v1/embeddings"}, "url must be the batch's endpoint"),
        ({**chat_line("a", "Hi"), "method": "GET"}, "method must be POST"),
        ({**chat_line("a", "Hi"), "body": {"messages": []}}, "body.model must name a model"),
        ({**chat_line("a", "Hi"), "body": {"model": SMOL, "stream": True}}, "body.stream must not be true"),
        ({**chat_line("", "Hi")}, "custom_id must be a string"),
        (chat_line("first", "Hi"), "custom_id 'first' is used by an earlier line"),
    ],
)
async def test_a_bad_line_refuses_the_batch_naming_it(api, line, words):
    file_id = await upload(api, [chat_line("first", "Hi"), line])
    response = await create(api, file_id, "/v1/chat/completions")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "input_file_id" and "Line 2" in error["message"] and words in error["message"], error
    assert not await Batch.objects.aexists()


async def test_the_request_itself_is_checked(api):
    file_id = await upload(api, [chat_line("a", "Hi")])
    for body, param in [
        ({"input_file_id": file_id, "endpoint": "/v1/images/generations"}, "endpoint"),
        (
            {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "1h"},
            "completion_window",
        ),
        ({"endpoint": "/v1/chat/completions"}, "input_file_id"),
        ({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "metadata": {"k": "v" * 513}}, "metadata"),
    ]:
        response = await post_json(api, "/v1/batches", body, **bearer("sk-a"))
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.content
    # Another key's file does not exist for this one.
    theirs = await upload(api, [chat_line("a", "Hi")], key="sk-b")
    assert (await create(api, theirs, "/v1/chat/completions")).status_code == 404


async def test_a_key_sees_and_cancels_only_its_own_batches(api):
    file_id = await upload(api, [embed_line("e", "hello")])
    batch = (await create(api, file_id, "/v1/embeddings")).json()
    for method, path in [("get", f"/v1/batches/{batch['id']}"), ("post", f"/v1/batches/{batch['id']}/cancel")]:
        response = await getattr(api, method)(path, headers=bearer("sk-b"))
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"
    assert (await api.get("/v1/batches", headers=bearer("sk-b"))).json()["data"] == []
    mine = (await api.get("/v1/batches", headers=bearer("sk-a"))).json()
    assert [b["id"] for b in mine["data"]] == [batch["id"]]
    assert [b["id"] for b in (await api.get("/v1/batches", headers=bearer(ADMIN))).json()["data"]] == [batch["id"]]
    await ended(api, batch["id"])


async def test_a_cancel_stops_the_batch_between_lines_and_keeps_what_was_done(api):
    lines = [chat_line(f"s{i}", f"Write a sentence about the number {i}.", max_tokens=24) for i in range(40)]
    batch = (await create(api, await upload(api, lines), "/v1/chat/completions")).json()
    deadline = time.monotonic() + WAIT_SECS
    while (await api.get(f"/v1/batches/{batch['id']}", headers=bearer("sk-a"))).json()["request_counts"][
        "completed"
    ] < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    cancelling = (await api.post(f"/v1/batches/{batch['id']}/cancel", headers=bearer("sk-a"))).json()
    assert cancelling["status"] in ("cancelling", "cancelled")
    done = await ended(api, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    counts = done["request_counts"]
    assert 1 <= counts["completed"] < 40 and counts["failed"] == 0
    output = await lines_of(api, done["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"s{i}" for i in range(counts["completed"])]


async def test_a_job_started_again_skips_the_lines_already_written(api):
    lines = [embed_line(f"e{i}", f"text {i}") for i in range(4)]
    admin = ApiPrincipal(label=default_label(ADMIN), admin=True)
    file_id = await upload(api, lines, key=ADMIN)
    create = sync_to_async(batches.create_batch)
    batch = await create(
        admin, input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h", metadata=None
    )
    # A job that died after writing line 1's result: its answer stays, its request is not made again.
    kept = batches.output_line("e1", 200, "req-" + "1" * 32, {"marker": "written before the restart"})
    await asyncio.to_thread(batches.append_result, batch.id, 1, True, kept)
    assert await batch_job.run_job(batch.id, get_client(), None) == {"completed": 4, "failed": 0}
    done = (await api.get(f"/v1/batches/{batch.id}", headers=bearer(ADMIN))).json()
    output = await lines_of(api, done["output_file_id"], key=ADMIN)
    assert [line["custom_id"] for line in output] == ["e0", "e1", "e2", "e3"]
    assert output[1] == kept
    assert all("data" in line["response"]["body"] for line in output[:1] + output[2:])
    # A job that finds its batch ended does nothing.
    assert await batch_job.run_job(batch.id, get_client(), None) is None


async def test_a_second_job_waits_while_another_holds_the_batch(api):
    admin = ApiPrincipal(label=default_label(ADMIN), admin=True)
    file_id = await upload(api, [embed_line("e0", "text")], key=ADMIN)
    create = sync_to_async(batches.create_batch)
    window = "24h"
    batch = await create(
        admin, input_file_id=file_id, endpoint="/v1/embeddings", completion_window=window, metadata=None
    )
    held_until = timezone.now() + timedelta(seconds=30)
    await Batch.objects.filter(id=batch.id).aupdate(lease_until=held_until)
    with pytest.raises(batch_job.BatchHeld) as held:
        await batch_job.run_job(batch.id, get_client(), None)
    assert 1 <= held.value.retry_in <= 30
    assert batches.written_results(batch.id) == {}
    # Once the hold has lapsed (its job died), the next delivery runs the batch.
    await Batch.objects.filter(id=batch.id).aupdate(lease_until=timezone.now() - timedelta(seconds=1))
    assert await batch_job.run_job(batch.id, get_client(), None) == {"completed": 1, "failed": 0}
    assert (await Batch.objects.aget(id=batch.id)).lease_until is None


async def test_the_lines_count_against_the_keys_tokens_per_day(api):
    lines = [chat_line(f"t{i}", "Tell me a long story about a dragon.", max_tokens=30) for i in range(4)]
    batch = (await create(api, await upload(api, lines, key="sk-daily"), "/v1/chat/completions", key="sk-daily")).json()
    done = await ended(api, batch["id"], key="sk-daily")
    assert done["status"] == "completed" and done["request_counts"]["failed"] >= 1, done
    errors = await lines_of(api, done["error_file_id"], key="sk-daily")
    assert {line["response"]["status_code"] for line in errors} == {429}
    assert errors[0]["response"]["body"]["error"]["code"] == "tokens_per_day"


async def spoken_wav(api: AsyncClient) -> tuple[bytes, str]:
    """A Piper WAV of SENTENCE and what the transcription route makes of it, asked directly."""
    speech = await post_json(api, "/v1/audio/speech", {"model": TTS, "input": SENTENCE}, **bearer("sk-a"))
    assert speech.status_code == 200, speech.content
    form = {"model": STT, "language": "en", "file": SimpleUploadedFile("speech.wav", speech.content, "audio/wav")}
    direct = await api.post("/v1/audio/transcriptions", form, headers=bearer("sk-a"))
    assert direct.status_code == 200, direct.content
    return speech.content, direct.json()["text"]


async def test_a_transcription_batch_answers_as_the_route_does_from_a_file_or_a_data_url(api):
    wav, heard = await spoken_wav(api)
    assert words(heard) == words(SENTENCE)
    audio_id = await upload_bytes(api, wav, "speech.wav", "user_data")
    data_url = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    lines = [
        transcription_line("from-file", audio_id),
        transcription_line("as-text", data_url, response_format="text"),
        transcription_line("verbose", audio_id, response_format="verbose_json", timestamp_granularities=["segment"]),
        # The route's own checks hold: a format it does not know is its 400.
        transcription_line("bad-format", data_url, response_format="xml"),
    ]
    batch = (await create(api, await upload(api, lines), batches.TRANSCRIPTIONS)).json()
    assert batch["endpoint"] == batches.TRANSCRIPTIONS
    done = await ended(api, batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    output = {line["custom_id"]: line["response"] for line in await lines_of(api, done["output_file_id"])}
    assert list(output) == ["from-file", "as-text", "verbose"]
    assert all(answer["status_code"] == 200 for answer in output.values())
    assert output["from-file"]["body"]["text"] == heard
    # A text answer is the output line's body as a JSON string, as the route sends it.
    assert output["as-text"]["body"] == heard + "\n"
    verbose = output["verbose"]["body"]
    assert verbose["text"] == heard and verbose["segments"] and verbose["language"]
    [refused] = await lines_of(api, done["error_file_id"])
    assert refused["custom_id"] == "bad-format" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "response_format"
    # An admin key may name any key's audio; the line runs with the admin's rights.
    admin_lines = [transcription_line("theirs", audio_id)]
    admin_batch = (
        await create(api, await upload(api, admin_lines, key=ADMIN), batches.TRANSCRIPTIONS, key=ADMIN)
    ).json()
    admin_done = await ended(api, admin_batch["id"], key=ADMIN)
    [theirs] = await lines_of(api, admin_done["output_file_id"], key=ADMIN)
    assert theirs["response"]["body"]["text"] == heard


async def test_a_transcription_line_whose_audio_is_gone_when_it_runs_fails_alone(api):
    admin = ApiPrincipal(label=default_label(ADMIN), admin=True)
    audio_id = await upload_bytes(api, b"RIFF" + b"\0" * 64, "gone.wav", "user_data", key=ADMIN)
    file_id = await upload(api, [transcription_line("gone", audio_id)], key=ADMIN)
    create_batch = sync_to_async(batches.create_batch)
    batch = await create_batch(
        admin, input_file_id=file_id, endpoint=batches.TRANSCRIPTIONS, completion_window="24h", metadata=None
    )
    assert (await api.delete(f"/v1/files/{audio_id}", headers=bearer(ADMIN))).status_code == 200
    assert await batch_job.run_job(batch.id, get_client(), None) == {"completed": 0, "failed": 1}
    done = (await api.get(f"/v1/batches/{batch.id}", headers=bearer(ADMIN))).json()
    [gone] = await lines_of(api, done["error_file_id"], key=ADMIN)
    assert gone["response"]["status_code"] == 404
    assert gone["response"]["body"]["error"] == {
        "message": f"No such File object: {audio_id}",
        "type": "not_found",
        "param": "file_id",
        "code": "not_found",
    }


@pytest.mark.parametrize(
    ("audio", "words_"),
    [
        ("file-" + "0" * 32, "No such File object"),
        ("theirs", "No such File object"),
        ("data:audio/wav;base64,not*base64", "does not hold valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "data: URL must read"),
        ("", "body.file must name the audio"),
    ],
)
async def test_a_transcription_line_must_name_audio_its_key_sees(api, audio, words_):
    if audio == "theirs":
        audio = await upload_bytes(api, b"RIFF" + b"\0" * 64, "theirs.wav", "user_data", key="sk-b")
    good = transcription_line("good", "data:audio/wav;base64,UklGRg==")
    file_id = await upload(api, [good, transcription_line("bad", audio)])
    response = await create(api, file_id, batches.TRANSCRIPTIONS)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "input_file_id" and "Line 2" in error["message"] and words_ in error["message"], error
    assert not await Batch.objects.aexists()


async def test_a_batch_whose_window_ends_before_its_first_line_expires_with_none_run(api, settings):
    with_server(settings, batch_window_secs=0.001)
    lines = [embed_line(f"e{i}", f"text {i}") for i in range(3)]
    batch = (await create(api, await upload(api, lines), "/v1/embeddings")).json()
    assert batch["completion_window"] == "24h"
    done = await ended(api, batch["id"])
    assert done["status"] == "expired" and done["expired_at"] is not None, done
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert done["output_file_id"] is None and done["completed_at"] is None
    expired = await lines_of(api, done["error_file_id"])
    assert [line["custom_id"] for line in expired] == ["e0", "e1", "e2"]
    assert all(line["response"] is None and line["error"]["code"] == "batch_expired" for line in expired)
    assert not batches.results_path(batch["id"]).exists()


async def test_a_batch_expires_between_lines_keeping_the_answers_it_has(api):
    lines = [chat_line(f"s{i}", f"Write a sentence about the number {i}.", max_tokens=24) for i in range(40)]
    batch = (await create(api, await upload(api, lines), "/v1/chat/completions")).json()
    deadline = time.monotonic() + WAIT_SECS
    while (await Batch.objects.aget(id=batch["id"])).completed < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    # The window ends now (as 24 h later would): the job sees it before its next line.
    await Batch.objects.filter(id=batch["id"]).aupdate(expires_at=timezone.now())
    done = await ended(api, batch["id"])
    assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"], done
    counts = done["request_counts"]
    assert 1 <= counts["completed"] < 40 and counts["completed"] + counts["failed"] == 40
    output = await lines_of(api, done["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"s{i}" for i in range(counts["completed"])]
    expired = await lines_of(api, done["error_file_id"])
    assert [line["custom_id"] for line in expired] == [f"s{i}" for i in range(counts["completed"], 40)]
    assert {line["error"]["code"] for line in expired} == {"batch_expired"}


def one_model_config(config: HypnosConfig, staged: HypnosConfig) -> HypnosConfig:
    """SmolLM2 and Qwen2.5-Coder-0.5B under a tier-1 budget that holds one of them only (as in
    tests/integration/test_tiers.py), both on disk at the start; their weights where the
    session's worker (`staged`) found them (this module's data_dir is a test's own)."""
    models = [
        m.model_copy(
            update={"initial_tier": "tier3_nvme_ssd", "context_len": 2048, "weights_path": str(staged.weights_file(m))}
        )
        for m in staged.models[:2]
    ]
    hardware = config.hardware.model_copy(update={"simulated_vram_bytes": 900_000_000, "min_gpu_layer_ratio": 1.0})
    return config.model_copy(update={"hardware": hardware, "models": models})


async def test_a_batch_waits_for_the_room_a_leased_model_holds_and_never_evicts_it(api, settings, worker, use_worker):
    tight = use_worker(Worker(one_model_config(settings.HYPNOS, worker.config)))
    tight.start()
    assert tight.wait_ready(60)
    chat = {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 4}
    first = await post_json(api, "/v1/chat/completions", chat, **bearer("sk-a"))
    assert first.status_code == 200, first.content
    tight.tiers.lease(SMOL, request=False)  # as if SMOL served a long interactive request
    try:
        lines = [chat_line(f"q{i}", "Say hello.", model=QWEN, max_tokens=2) for i in range(2)]
        batch = (await create(api, await upload(api, lines), "/v1/chat/completions")).json()
        # The first line holds Qwen's slot and waits in the worker: no 507, no eviction.
        assert await wait_until(lambda: tight.models[QWEN].background_running == 1, timeout=60)
        assert tight.tiers.entries[SMOL].tier == "tier1_gpu_vram"
        assert tight.tiers.entries[QWEN].tier != "tier1_gpu_vram"
        # Interactive traffic on the leased model goes on meanwhile.
        answer = await post_json(api, "/v1/chat/completions", chat, **bearer("sk-a"))
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        waiting = (await api.get(f"/v1/batches/{batch['id']}", headers=bearer("sk-a"))).json()
        assert waiting["status"] == "in_progress" and waiting["request_counts"]["completed"] == 0
    finally:
        tight.tiers.release(SMOL, served=False)
    done = await ended(api, batch["id"])
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}, done
    output = await lines_of(api, done["output_file_id"])
    assert output[0]["response"]["body"]["hypnos_telemetry"]["evicted_models"] == [SMOL]
    assert tight.tiers.entries[QWEN].tier == "tier1_gpu_vram"
