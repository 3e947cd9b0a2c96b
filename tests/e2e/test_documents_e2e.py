"""Document conversion between real processes (spec §12): embedded (one daphne, Celery tasks in
the server process) and distributed (two daphne processes, `manage.py runinference`, a real
Celery worker on the Redis broker, PostgreSQL), over HTTP with a real client."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests import documents
from tests.e2e.conftest import SILENCE_SECS, Server, start_celery

pytestmark = pytest.mark.e2e
URL = "/v1/documents/convert"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("e2e-documents")
    return {
        "pdf": documents.multipage_pdf(folder / "report.pdf"),
        "scans": documents.scanned_pages_pdf(folder / "scans.pdf", 8),
    }


def events_of(lines: list[str]) -> list[Any]:
    return [
        line[len("data: ") :] if line == "data: [DONE]" else json.loads(line[len("data: ") :])
        for line in lines
        if line.startswith("data: ")
    ]


@contextmanager
def streamed(base_url: str, path: Path) -> Iterator[tuple[str, Iterator[str]]]:
    """A streamed conversion read up to its first page: its request id and the rest of its lines;
    the connection closes when the block ends."""
    with (
        open(path, "rb") as file,
        httpx.stream(
            "POST",
            f"{base_url}{URL}",
            data={"model": "docling", "stream": "true"},
            files={"file": (path.name, file, "application/pdf")},
            timeout=300,
        ) as response,
    ):
        lines = response.iter_lines()
        for line in lines:
            if '"document.page"' in line:
                break
        yield response.headers["x-request-id"], lines


def convert(base_url: str, path: Path, **fields: str) -> httpx.Response:
    with open(path, "rb") as file:
        return httpx.post(
            f"{base_url}{URL}",
            data={"model": "docling", **fields},
            files={"file": (path.name, file, "application/pdf")},
            timeout=300,
        )


def test_a_streamed_conversion_sends_its_pages_as_they_are_ready(server: Server, files):
    with (
        open(files["pdf"], "rb") as file,
        httpx.stream(
            "POST",
            f"{server.base_url}{URL}",
            data={"model": "docling", "stream": "true"},
            files={"file": ("report.pdf", file, "application/pdf")},
            timeout=300,
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        events = events_of(list(response.iter_lines()))
    kinds = [e if isinstance(e, str) else e["object"] for e in events]
    assert kinds == ["document.started", "document.page", "document.page", "document.page", "document", "[DONE]"]
    assert events[0]["pages"] == [1, 2, 3]
    assert documents.TITLE in events[1]["markdown"]
    assert events[4]["usage"]["pages"] == 3 and events[4]["hypnos_telemetry"]["engine"]["pages"] == 3


def test_a_refusal_is_its_status_streamed_or_not(server: Server, files):
    for stream in ("false", "true"):
        response = convert(server.base_url, files["pdf"], pages="9", stream=stream)
        assert response.status_code == 400 and response.json()["error"]["param"] == "pages"


def test_pictures_stored_through_one_web_process_are_served_by_the_other(distributed: Server, files):
    body = convert(distributed.base_url, files["pdf"], return_pictures="true").json()
    url = body["pages"][1]["picture_urls"][0]
    assert distributed.other_base_url is not None
    image = httpx.get(f"{distributed.other_base_url}{url}?format=image", timeout=30)
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    assert image.headers["cache-control"] == "private, no-store"
    deleted = httpx.delete(f"{distributed.other_base_url}/v1/documents/{body['id']}", timeout=30)
    assert deleted.json() == {"object": "document.deleted", "id": body["id"], "deleted": True}
    assert httpx.get(f"{distributed.base_url}{url}", timeout=30).status_code == 404


def test_expired_pictures_are_gone_from_every_web_process(distributed: Server, files):
    body = convert(distributed.base_url, files["pdf"], return_pictures="true").json()
    with psycopg.connect(distributed.env["HYPNOS_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "UPDATE logs_storeddocument SET expires_at = now() - interval '1 second' WHERE id = %s", (body["id"],)
        )
    # The store looks for expired documents at most every 5 s.
    deadline = time.monotonic() + 60
    while (
        listed := httpx.get(f"{distributed.other_base_url}/v1/documents/{body['id']}/pictures", timeout=30)
    ).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert listed.status_code == 404


def test_the_job_runs_on_the_celery_worker_and_its_state_is_in_the_database(distributed: Server, files):
    response = convert(distributed.base_url, files["pdf"])
    assert response.status_code == 200
    with psycopg.connect(distributed.env["HYPNOS_DATABASE_URL"], autocommit=True) as conn:
        job = conn.execute(
            "SELECT id, state, pages_done FROM logs_documentjob WHERE request_id = %s",
            (response.headers["x-request-id"],),
        ).fetchone()
        assert job is not None and job[1:] == ("done", 3)
        # Celery records SUCCESS once the task function has returned, which can come after the
        # response's last byte (the job's state is written first): wait for it.
        deadline = time.monotonic() + 30
        while True:
            task = conn.execute(
                "SELECT status, worker FROM django_celery_results_taskresult WHERE task_id = %s", (job[0],)
            ).fetchone()
            if (task is not None and task[0] == "SUCCESS") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert task is not None and task[0] == "SUCCESS" and task[1].startswith("celery@")
    celery_log = next(p for p in distributed.procs if p.name.startswith("celery")).log.read_text(errors="replace")
    assert job[0] in celery_log


def test_a_client_that_leaves_after_the_first_page_stops_the_job(distributed: Server, files):
    with streamed(distributed.base_url, files["scans"]) as (request_id, _lines):
        pass
    # Counted from outside: the job's row in PostgreSQL (the page under way ends first: ~2 s idle).
    deadline = time.monotonic() + 60
    with psycopg.connect(distributed.env["HYPNOS_DATABASE_URL"], autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT state, pages_done FROM logs_documentjob WHERE request_id = %s", (request_id,)
            ).fetchone()
            if row is not None and row[0] != "running":
                break
            time.sleep(0.1)
        assert row is not None and row[0] == "cancelled", row
        time.sleep(1.5)
        again = conn.execute("SELECT pages_done FROM logs_documentjob WHERE request_id = %s", (request_id,)).fetchone()
    # At most the page being converted when the client left runs after the first.
    assert again is not None and again[0] == row[1] <= 2


def test_a_job_whose_celery_worker_dies_ends_its_stream_with_an_error(distributed: Server, files):
    """SIGKILL the Celery worker in the middle of a job: the stream ends with an error event
    and [DONE] once the job's heartbeats stop (server.job_silence_secs, SILENCE_SECS in the suite's
    e2e config), and the job's row says failed.
    The fixture's worker is swapped for one that is killed, then for a fresh one."""
    current = next(p for p in distributed.procs if p.name.startswith("celery"))
    current.stop()
    distributed.procs.remove(current)
    doomed = start_celery(distributed.env, current.log.parent, name="celery-doomed")
    try:
        with streamed(distributed.base_url, files["scans"]) as (request_id, lines):
            doomed.popen.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            rest = events_of(list(lines))
        ended_after = time.monotonic() - killed_at
    finally:
        doomed.stop()
        distributed.procs.append(start_celery(distributed.env, current.log.parent, name="celery-2"))
    assert [e if isinstance(e, str) else e["object"] for e in rest][-2:] == ["error", "[DONE]"]
    assert rest[-2]["error"]["type"] == "model_not_available" and "stopped reporting" in rest[-2]["error"]["message"]
    # The feed's deadline ends it (SILENCE_SECS after the last heartbeat, so at most that long
    # after the kill; 4.0 s measured idle); the 10 s more are a busy machine's slack.
    assert ended_after < SILENCE_SECS + 10
    with psycopg.connect(distributed.env["HYPNOS_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT state, error FROM logs_documentjob WHERE request_id = %s", (request_id,)).fetchone()
    assert row is not None and row[0] == "failed" and "stopped reporting" in row[1]
