"""The official `openai` SDK and raw HTTP against both deployments, over real sockets."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
LONG_STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


def sdk(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_sdk_gets_the_models_real_answer(server):
    completion = sdk(server).chat.completions.create(model=MODEL, messages=PARIS_MESSAGES, temperature=0)
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens > 3
    telemetry = completion.model_extra["hypnos_telemetry"]
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"


def test_the_sdk_streams_the_same_answer(server):
    client = sdk(server)
    whole = client.chat.completions.create(model=MODEL, messages=PARIS_MESSAGES, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS_MESSAGES, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].model_extra["hypnos_telemetry"]["engine"]["decode_tokens_per_s"] > 0


def test_an_unknown_model_raises_the_sdks_not_found(server):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(server).chat.completions.create(model="no-such-model", messages=PARIS_MESSAGES)
    assert caught.value.body["code"] == "model_not_found"


def test_the_sdk_lists_the_models(server):
    assert [m.id for m in sdk(server).models.list()] == [
        MODEL,
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "all-minilm-l6-v2",
        "whisper-tiny.en",
        "piper-joe",
        "docling",
        "dcgan-faces",
        "realesrgan-x4",
    ]


def test_raw_http_gets_request_ids_and_json_errors(server):
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert re.fullmatch(r"req-[0-9a-f]{32}", response.headers["x-request-id"])
    assert response.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(f"{server.base_url}/v1/does-not-exist")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


def test_closing_the_stream_frees_the_model_at_once(server):
    body = {"model": MODEL, "messages": LONG_STORY, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert len(received) >= 3
    # 2000 tokens would hold the model's only slot for ~30 s; the next request must not wait for it.
    after = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": PARIS_MESSAGES, "max_tokens": 2},
    )
    assert after.status_code == 200
    # Idle it waits a few ms; a slot still held would make it wait the story's ~30 s (more when busy).
    assert after.json()["hypnos_telemetry"]["engine"]["queue_ms"] < 10_000


def test_a_raw_stream_ends_with_usage_telemetry_and_done(server):
    body = {"model": MODEL, "messages": PARIS_MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 5
    assert "hypnos_telemetry" in final


def test_the_sdk_uploads_lists_reads_and_deletes_a_batch_file(server, tmp_path):
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "e", "input": "hi"}}
        for i in range(3)
    ]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = sdk(server)
    created = client.files.create(file=source.open("rb"), purpose="batch")
    assert created.id.startswith("file-") and created.filename == "requests.jsonl"
    assert created.bytes == source.stat().st_size and created.purpose == "batch"
    assert created.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.retrieve(created.id).bytes == created.bytes
    assert client.files.content(created.id).read() == source.read_bytes()
    assert client.files.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_the_sdk_runs_a_batch_to_its_output_file(server, tmp_path):
    """A batch submitted, run by the deployment's jobs (a Celery worker, distributed; a thread,
    embedded) and read back as the SDK reads it: every custom_id answered once, in order."""
    questions = [f"What is {i} plus {i}?" for i in range(6)]
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8},
        }
        for i, text in enumerate(questions)
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = sdk(server)
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "in_progress" and batch.request_counts.total == 6
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.25)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"q{i}" for i in range(6)]
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert batch.id in [b.id for b in client.batches.list()]
