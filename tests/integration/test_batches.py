"""The Batch API (POST/GET /v1/batches, GET /v1/batches/{id}, POST .../cancel) on the embedded
deployment: real models answer every line through the server's own routes, the output and
error files come back in input order, a bad line refuses the batch naming it, a cancel stops it
between lines, a job started again does nothing twice, and the keys' rights and quotas hold."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient
from django.test.client import encode_multipart
from django.utils import timezone

from hypnos_site.config import KeyConfig
from inference.jobs import batches as batch_job
from inference.transport.runtime import get_client
from logs import batches
from logs.models import Batch
from models_registry.authentication import ApiPrincipal, default_label
from tests.integration.conftest import post_json, with_server

pytestmark = pytest.mark.django_db(transaction=True)
ADMIN = "sk-admin-test"
SMOL = "smollm2-135m"
EMBED = "all-minilm-l6-v2"
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


async def upload(api: AsyncClient, lines: list[Any], key: str = "sk-a") -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()

    class Part:
        name = "batch.jsonl"

        def read(self) -> bytes:
            return content

    response = await api.post(
        "/v1/files",
        data=encode_multipart(BOUNDARY, {"file": Part(), "purpose": "batch"}),
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
