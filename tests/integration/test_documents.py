"""POST /v1/documents/convert (spec §12) through the real route, Celery (eager: the embedded
deployment runs the task in the server process) and the real docling engine, on documents the
tests make (tests/documents.py). The distributed deployment (a real Celery worker on Redis,
PostgreSQL, two web processes) is tests/e2e/test_documents_e2e.py."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import AsyncClient
from django_celery_results.models import TaskResult

from inference.transport.deadline import within
from inference.web.common import image_input
from inference.worker import Worker
from logs.models import DocumentJob, StoredDocument
from tests import documents
from tests.integration.conftest import post_json, read_in_background, read_sse, wait_until, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/documents/convert"
DOCLING = "docling"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("documents")
    return {
        "pdf": documents.multipage_pdf(folder / "report.pdf"),
        "long": documents.long_pdf(folder / "long.pdf", 40),
        "scans": documents.scanned_pages_pdf(folder / "scans.pdf", 8),
        "scan": documents.scanned_pdf(folder / "scan.pdf", "Invoice number 4711\nTotal due 99 euros"),
        "docx": documents.docx_file(folder / "plan.docx"),
        "html": documents.html_file(folder / "page.html"),
        "truncated": documents.truncated_pdf(folder / "cut.pdf"),
        "encrypted": documents.encrypted_pdf(folder / "locked.pdf"),
    }


async def upload(api: AsyncClient, path: Path, **fields: Any) -> Any:
    with open(path, "rb") as file:
        return await api.post(URL, data={"model": DOCLING, "file": file, **fields})


def leftovers() -> list[Path]:
    """What a conversion may leave in the spool: nothing once it has ended."""
    spool = django_settings.HYPNOS.data_dir / "spool"
    return sorted(p for p in spool.glob("*") if ".document" in p.name or p.name.endswith("-pictures"))


async def stored_result(task_id: str) -> TaskResult:
    for _ in range(500):
        found = await TaskResult.objects.filter(task_id=task_id, status="SUCCESS").afirst()
        if found is not None:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no stored result for {task_id}")


async def test_a_multipage_pdf_converts_page_by_page_with_its_telemetry(api, files):
    response = await upload(api, files["pdf"])
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "document" and body["model"] == DOCLING and body["filename"] == "report.pdf"
    assert body["page_count"] == 3 and [p["page"] for p in body["pages"]] == [1, 2, 3]
    assert documents.TITLE in body["pages"][0]["markdown"]
    assert body["pages"][1]["pictures"] == 1 and "<!-- image -->" in body["pages"][1]["markdown"]
    # The sentence the first page break cut is one sentence in the joined Markdown.
    assert " ".join(documents.CUT_SENTENCE) in body["markdown"]
    assert body["usage"] == {"pages": 3, "pictures": 1, "tables": body["usage"]["tables"], "pictures_described": 0}
    engine = body["hypnos_telemetry"]["engine"]
    assert engine["pages"] == 3 and engine["ms_per_page"] > 0 and engine["pipeline"] == "native_pdf"
    assert "id" not in body and "picture_urls" not in body["pages"][0]
    job = await DocumentJob.objects.aget(request_id=response["x-request-id"])
    assert (job.state, job.pages_done, job.pages_total) == ("done", 3, 3) and job.duration_ms > 0
    # The task's result is stored once it returns, just after the response's last event.
    result = await stored_result(job.id)
    assert json.loads(result.result)["page_count"] == 3
    assert leftovers() == []


async def test_a_stream_sends_each_page_then_the_document(api, files):
    response = await upload(api, files["pdf"], stream="true")
    assert response.status_code == 200 and response["content-type"].startswith("text/event-stream")
    events = await read_sse(response)
    assert [e if e == "[DONE]" else e["object"] for e in events] == [
        "document.started",
        "document.page",
        "document.page",
        "document.page",
        "document",
        "[DONE]",
    ]
    assert events[0]["page_count"] == 3 and events[0]["pages"] == [1, 2, 3]
    assert [e["page"] for e in events[1:4]] == [1, 2, 3]
    final = events[4]
    assert final["pages"] == [] and final["usage"]["pages"] == 3 and documents.TITLE in final["markdown"]


async def test_pages_selects_part_of_the_document(api, files):
    body = (await upload(api, files["long"], pages="3-4")).json()
    assert body["page_count"] == 40 and [p["page"] for p in body["pages"]] == [3, 4]
    assert "Page 3 heading" in body["markdown"] and "Page 5 heading" not in body["markdown"]


async def test_docx_and_html_are_one_page_each_in_json_and_multipart(api, files):
    docx = base64.b64encode(files["docx"].read_bytes()).decode()
    response = await post_json(api, URL, {"model": DOCLING, "file": docx, "filename": "plan.docx"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["page_count"] == 1 and "Project Plan" in body["markdown"] and "| Build" in body["markdown"]
    assert body["usage"]["tables"] == 1 and body["usage"]["pictures"] == 1
    html = "data:text/html;base64," + base64.b64encode(files["html"].read_bytes()).decode()
    body = (await post_json(api, URL, {"model": DOCLING, "file": html, "output_format": "json"})).json()
    assert "# Inference Server" in body["markdown"] and body["hypnos_telemetry"]["engine"]["pipeline"] == "simple"
    assert isinstance(body["pages"][0]["json"], dict)


async def test_a_scanned_page_is_read_by_ocr_unless_ocr_is_off(api, files):
    body = (await upload(api, files["scan"])).json()
    assert "4711" in body["markdown"] and "Total" in body["markdown"]
    assert body["pages"][0]["markdown"].strip()
    blind = (await upload(api, files["scan"], ocr="false")).json()
    assert "4711" not in blind["markdown"]


@pytest.mark.parametrize("stream", [False, True])
async def test_every_refusal_has_its_status_before_the_first_byte(api, files, tmp_path, stream):
    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    unknown = tmp_path / "data.bin"
    unknown.write_bytes(bytes(range(256)) * 8)
    cases = [
        (upload(api, files["pdf"], pages="5", stream=str(stream)), 400, "pages"),
        (upload(api, files["truncated"], stream=str(stream)), 400, "file"),
        (upload(api, files["encrypted"], stream=str(stream)), 400, "file"),
        (upload(api, empty, stream=str(stream)), 400, "file"),
        (upload(api, unknown, stream=str(stream)), 400, "file"),
        (upload(api, files["pdf"], model="smollm2-135m", stream=str(stream)), 400, "model"),
        (upload(api, files["pdf"], model="no-such-model", stream=str(stream)), 404, "model"),
        (upload(api, files["pdf"], describe_pictures="smollm2-135m", stream=str(stream)), 400, "describe_pictures"),
        (upload(api, files["pdf"], pages="two", stream=str(stream)), 400, "pages"),
    ]
    for request, status, param in cases:
        response = await request
        assert response.status_code == status, (param, response.content)
        assert response["content-type"] == "application/json"
        assert response.json()["error"]["param"] == param
    assert leftovers() == []


async def test_a_document_above_max_document_bytes_is_a_400_in_the_envelope(api, files, settings):
    """Spec §1: 400 (the 413 is the body-limit layer's, for max_body_bytes)."""
    with_limits(settings, max_document_bytes=2048)
    response = await upload(api, files["pdf"])
    error = response.json()["error"]
    assert response.status_code == 400 and (error["type"], error["code"]) == (
        "invalid_request_error",
        "payload_too_large",
    )
    inline = base64.b64encode(files["pdf"].read_bytes()).decode()
    response = await post_json(api, URL, {"model": DOCLING, "file": inline})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


async def test_a_document_with_more_pages_than_the_cap_is_refused(api, files, settings):
    with_limits(settings, max_document_pages=10)
    response = await upload(api, files["long"])
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert "10" in response.json()["error"]["message"]


async def test_return_pictures_keeps_them_in_the_store(api, files):
    body = (await upload(api, files["pdf"], return_pictures="yes")).json()
    document_id = body["id"]
    assert document_id.startswith("doc-") and body["pictures_expire_at"].endswith("Z")
    assert body["pages"][1]["picture_urls"] == [f"/v1/documents/{document_id}/pictures/1"]
    assert body["pages"][0]["picture_urls"] == []
    listed = (await api.get(f"/v1/documents/{document_id}/pictures")).json()
    assert [p["page"] for p in listed["data"]] == [2]
    image = await api.get(f"/v1/documents/{document_id}/pictures/1?format=image")
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    assert leftovers() == []


async def test_a_failed_conversion_keeps_no_pictures(api, files):
    before = await StoredDocument.objects.acount()
    response = await upload(api, files["truncated"], return_pictures="true")
    assert response.status_code == 400
    assert await StoredDocument.objects.acount() == before and leftovers() == []


async def test_a_client_that_leaves_stops_the_job_at_the_next_page(api, files, worker):
    response = await upload(api, files["scans"], stream="true")
    consumer, chunks = read_in_background(response)
    assert await wait_until(lambda: b"document.page" in b"".join(chunks), 60)
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    job = await DocumentJob.objects.aget(request_id=response["x-request-id"])

    async def settled() -> DocumentJob:
        while True:
            found = await DocumentJob.objects.aget(pk=job.pk)
            if found.state != "running":
                return found
            await asyncio.sleep(0.05)

    ended = await within(settled(), 60)
    assert ended.state == "cancelled" and ended.cancel_requested, (
        ended.state,
        ended.pages_done,
        ended.cancel_requested,
    )
    assert ended.pages_done <= 2  # the page being converted when the client left, at most
    await asyncio.sleep(1.0)  # nothing converts once the job ended
    assert (await DocumentJob.objects.aget(pk=job.pk)).pages_done == ended.pages_done
    assert leftovers() == []
    # The page being converted when the client left runs to its end (OCR: ~2 s), then the lease goes.
    assert await wait_until(lambda: worker.tiers.leases(DOCLING) == 0, 60)


@pytest.fixture
def local_files(files) -> Iterator[str]:
    """The test documents over HTTP on loopback, with /redirect-metadata pointing at the cloud
    metadata address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/redirect-metadata":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
                self.end_headers()
                return
            data = files["pdf"].read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/pdf")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_a_url_is_fetched_under_the_image_url_rules(api, local_files, monkeypatch):
    refused = await post_json(api, URL, {"model": DOCLING, "url": f"{local_files}/report.pdf"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
    assert "non-public address" in refused.json()["error"]["message"]
    # Loopback stands in for a public host; the redirect to the metadata address is still refused.
    from_limits = image_input.ImagePolicy.from_limits

    def loopback_is_public(limits: Any) -> image_input.ImagePolicy:
        return dataclasses.replace(from_limits(limits), public=lambda a: str(a) == "127.0.0.1")

    monkeypatch.setattr(image_input.ImagePolicy, "from_limits", staticmethod(loopback_is_public))
    body = (await post_json(api, URL, {"model": DOCLING, "url": f"{local_files}/report.pdf"})).json()
    assert body["filename"] == "report.pdf" and body["page_count"] == 3
    redirected = await post_json(api, URL, {"model": DOCLING, "url": f"{local_files}/redirect-metadata"})
    assert redirected.status_code == 400 and "169.254.169.254" in redirected.json()["error"]["message"]


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    from memory.gguf import read_gguf
    from tests.integration.test_vision import write_tiny_projector

    smol = next(m for m in django_settings.HYPNOS.models if m.id == "smollm2-135m")
    path = tmp_path_factory.mktemp("vision") / "tiny-mmproj.gguf"
    write_tiny_projector(
        path, int(read_gguf(django_settings.HYPNOS.weights_file(smol)).metadata["llama.embedding_length"])
    )
    return path


@pytest.fixture
def seeing_and_docling(settings, serve, projector) -> Worker:
    """docling beside `smollm2-seeing`: SmolLM2 with the vision tests' tiny random projector
    (it proves the path, not that the description is good)."""
    models = {m.id: m for m in settings.HYPNOS.models}
    seeing = models["smollm2-135m"].model_copy(
        update={"id": "smollm2-seeing", "aliases": [], "aux_path": str(projector), "speech_to_text_model": None}
    )
    settings.HYPNOS = settings.HYPNOS.model_copy(update={"models": [seeing, models[DOCLING]]})
    return serve(settings.HYPNOS)


async def test_describe_pictures_puts_the_vision_models_words_under_each_picture(api, files, seeing_and_docling):
    body = (await upload(api, files["pdf"], describe_pictures="smollm2-seeing")).json()
    page = body["pages"][1]["markdown"]
    assert "<!-- image -->\n\n> **Picture:** " in page
    assert body["usage"]["pictures_described"] == 1
    assert body["hypnos_telemetry"]["engine"]["pictures_described"] == 1


async def test_a_job_that_crashes_ends_its_stream_with_an_error_and_leaves_nothing(api, files, monkeypatch):
    from inference.jobs import documents as document_job

    def broken(pages: list[str]) -> str:
        raise RuntimeError("the joiner broke")

    monkeypatch.setattr(document_job, "join_pages", broken)
    response = await upload(api, files["pdf"], stream="true", return_pictures="true")
    assert response.status_code == 200
    events = await read_sse(response)
    assert [e if e == "[DONE]" else e["object"] for e in events][-2:] == ["error", "[DONE]"]
    assert events[-2]["error"]["type"] == "server_error" and "the joiner broke" in events[-2]["error"]["message"]
    job = await DocumentJob.objects.aget(request_id=response["x-request-id"])
    assert job.state == "failed" and "the joiner broke" in job.error
    assert not await StoredDocument.objects.filter(id=job.document_id).aexists()
    assert leftovers() == []
    response = await upload(api, files["pdf"])
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


async def test_docling_is_placed_in_the_tiers_like_every_model(api, files, worker):
    listed = {m["id"]: m for m in (await api.get("/v1/models")).json()["data"]}
    assert listed[DOCLING]["modality"] == "document_conversion"
    status = (await api.get("/v1/memory/status")).json()
    entry = next(m for m in status["models"] if m["id"] == DOCLING)
    assert "document_conversion" in entry["modalities"]
    # Out to disk, then a conversion brings it back: the load is in the telemetry.
    down = await post_json(api, "/v1/memory/tier", {"model": DOCLING, "target_tier": "tier3_nvme_ssd"})
    assert down.status_code == 200, down.content
    body = (await upload(api, files["pdf"])).json()
    telemetry = body["hypnos_telemetry"]
    assert telemetry["previous_tier"] == "tier3_nvme_ssd" and telemetry["tier_switch_latency_ms"] > 0
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"
    again = (await upload(api, files["pdf"])).json()["hypnos_telemetry"]
    assert again["previous_tier"] == "tier1_gpu_vram" and again["tier_switch_latency_ms"] == 0
    assert worker.tiers.leases(DOCLING) == 0


async def test_the_document_metric_families_count_pages(api, files):
    await upload(api, files["pdf"])
    page = (await api.get("/metrics")).content.decode()
    pages = [line for line in page.splitlines() if line.startswith('hypnos_document_pages_total{model="docling"}')]
    assert pages and float(pages[0].split()[-1]) >= 3
    assert 'hypnos_document_ms_per_page_bucket{le="+Inf",model="docling"}' in page or (
        "hypnos_document_ms_per_page_count" in page
    )
