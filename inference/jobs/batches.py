"""The Batch API's job: a batch's lines run one at a time through the server's own URL table.

Each line is a request to the batch's endpoint, made in this process through Django's ASGI
handler, the same middleware and views an HTTP request meets: the key's rights and quotas
(tokens per day) count as the lines run, each line has its request id and its request-log entry,
and its answer is the route's own, status and body. The request carries the KeyCheck of the
batch's key (as it stands when the job starts) on its ASGI scope; no client can put one there
(a scope is made by the server from the connection), and this handler is never the one that
serves the socket.

Lines run grouped by model, so each model is promoted once, one at a time, each with
`x-hypnos-priority: background`: a line takes a slot only while no interactive request waits for
one. A line answered "not now" (503 while a restarted server stages its models, 429 for a full
queue or the key's rate) is sent again after a pause; other answers are its result. Before
each line the job reads the batch's cancel flag and its expiry: a batch whose completion window
has ended (before its first line too: a job that waited in the queue) runs no more lines and
ends expired. Each result is written (logs.batches.append_result) before the next line starts;
a job started again skips the written ones.

A transcription line's body is JSON naming its audio (logs.batches.line_audio); the job sends
the route the multipart/form-data upload a client would, the audio as the `file` part and the
body's other fields as text parts. A text answer (response_format text, srt, vtt) is the
output line's body as a JSON string.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.db.models import F, Q
from django.utils import timezone

from hypnos_site.errors import AuthenticationError, HypnosError
from hypnos_site.handler import PooledASGIHandler
from inference.transport.client import InferenceClient
from inference.transport.runtime import runtime
from logs import batches, files
from logs.models import Batch, StoredFile
from models_registry.authentication import KeyCheck, check_for_label

log = logging.getLogger(__name__)
KEY_CHECK = "hypnos.key_check"
# A line answered "not now" (503: no worker ready yet, a restart's staging; 429 but for the
# daily token quota: a full queue, the key's rate) is sent again, after the answer's
# Retry-After or a doubling pause, for up to this long; then its last answer is its result.
RETRY_FOR_SECS = 600.0
RETRY_PAUSE_MAX_SECS = 30.0


def lease_secs() -> float:
    return float(settings.HYPNOS.server.batch_lease_secs)


class BatchHeld(Exception):
    """Another job holds the batch (a second delivery of its task): try again once its hold
    would have lapsed."""

    def __init__(self, retry_in: float) -> None:
        super().__init__(f"held by another job for {retry_in:.0f} s more")
        self.retry_in = retry_in


class _LineRequest(ASGIRequest):
    """A batch line's request: authenticated by the KeyCheck the job put on its scope."""

    def __init__(self, scope: dict[str, Any], body_file: Any) -> None:
        super().__init__(scope, body_file)
        self.hypnos_key_check = scope[KEY_CHECK]


class _LineHandler(PooledASGIHandler):
    """The server's own handler and middleware chain, its requests authenticated by the scope."""

    request_class = _LineRequest


def retry_after(status: int, headers: dict[str, str], answer: Any) -> float | None:
    """How long to wait before sending a line again, or None when its answer is its result."""
    error = answer.get("error") if isinstance(answer, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if status != 503 and not (status == 429 and code != "tokens_per_day"):
        return None
    try:
        return min(max(float(headers.get("retry-after", "")), 0.1), RETRY_PAUSE_MAX_SECS)
    except ValueError:
        return 0.0  # the caller's own doubling pause


async def send_line(
    handler: ASGIHandler,
    path: str,
    body: bytes,
    check: KeyCheck,
    stopped: Callable[[], Awaitable[str | None]],
    content_type: str = "application/json",
) -> tuple[int, str, Any] | None:
    """One line's answer: sent again while it is a "not now" (retry_after), for RETRY_FOR_SECS
    at most; None when the batch is cancelled or expires meanwhile (the line is not done)."""
    deadline = asyncio.get_running_loop().time() + RETRY_FOR_SECS
    pause = 0.5
    while True:
        status, request_id, headers, answer = await call(handler, path, body, check, content_type)
        wait = retry_after(status, headers, answer)
        if wait is None or asyncio.get_running_loop().time() + (wait or pause) > deadline:
            return status, request_id, answer
        await asyncio.sleep(wait or pause)
        pause = min(pause * 2, RETRY_PAUSE_MAX_SECS)
        if await stopped():
            return None


def multipart(fields: dict[str, Any], audio: bytes, filename: str) -> tuple[bytes, str]:
    """A transcription line as the route's multipart/form-data upload, encoded by httpx as a
    client's SDK would send it: the body's fields as text parts (a list as repeated `name[]`
    parts, as the SDKs send timestamp_granularities), the audio as the `file` part; the body
    and its content type."""
    data: dict[str, Any] = {}
    for name, value in fields.items():
        if name == "file" or value is None:
            continue
        texts = [_form_text(item) for item in (value if isinstance(value, list) else [value])]
        data[f"{name}[]" if isinstance(value, list) else name] = texts if isinstance(value, list) else texts[0]
    upload = {"file": (filename or "audio", audio, "application/octet-stream")}
    request = httpx.Request("POST", "http://hypnos-batch/", data=data, files=upload)
    return request.read(), request.headers["content-type"]


def _form_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


async def line_request(endpoint: str, body: bytes, check: KeyCheck) -> tuple[bytes, str]:
    """What the job sends for a line: its JSON body, or a transcription's multipart upload (its
    audio read now: a file the batch's key still sees, or the line's data: URL). A HypnosError
    when the audio cannot be read: that is the line's answer."""
    if endpoint != batches.TRANSCRIPTIONS:
        return body, "application/json"
    if check.refused:
        raise AuthenticationError(check.problem or "The key that created this batch is no longer active.")
    fields = json.loads(body)
    audio, filename = await sync_to_async(batches.line_audio)(fields, check.principal)
    return await asyncio.to_thread(multipart, fields, audio, filename)


async def call(
    handler: ASGIHandler, path: str, body: bytes, check: KeyCheck, content_type: str = "application/json"
) -> tuple[int, str, dict[str, str], Any]:
    """POST `body` to `path` through `handler`: the answer's status, request id, headers and
    body (JSON as parsed; a text/* answer as its text)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"user-agent", b"hypnos-batch"),
            # A slot only while no interactive request waits for one (inference/worker/core.py).
            (b"x-hypnos-priority", b"background"),
        ],
        "client": ("127.0.0.1", 0),
        "server": ("localhost", 80),
        KEY_CHECK: check,
    }
    delivered = False
    status, headers, chunks = 500, [], []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the caller never leaves: the handler cancels this wait
        raise AssertionError("unreachable")

    async def send(message: Mapping[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await handler(scope, receive, send)
    named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    raw = b"".join(chunks)
    answer: Any
    if named.get("content-type", "").startswith("text/"):
        answer = raw.decode(errors="replace")
    else:
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"error": {"message": raw.decode(errors="replace")[:1000], "type": "server_error"}}
    return status, named.get("x-request-id", ""), named, answer


async def run_job(batch_id: str, client: InferenceClient, channels: Any) -> dict[str, Any] | None:
    """Run the batch's pending lines, then write its output and error files; the batch ends
    completed, cancelled (its cancel flag seen before a line), expired (its completion window
    ended before a line) or failed (the job itself broke)."""
    batch = await Batch.objects.aget(id=batch_id)
    if batch.status in batches.TERMINAL:
        return None
    now = timezone.now()
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    if not await Batch.objects.filter(free, id=batch_id).aupdate(lease_until=now + timedelta(seconds=lease_secs())):
        held = await Batch.objects.aget(id=batch_id)
        raise BatchHeld(max((held.lease_until - now).total_seconds(), 1.0) if held.lease_until else 1.0)
    keeper = asyncio.create_task(_keep_lease(batch_id))
    try:
        return await _run(batch, client)
    except Exception as exc:
        log.exception("batch %s failed", batch_id)
        await Batch.objects.filter(id=batch_id).aupdate(
            status="failed",
            failed_at=timezone.now(),
            current_model="",
            errors=[{"code": "server_error", "message": f"{type(exc).__name__}: {exc}", "param": None, "line": None}],
        )
        return None
    finally:
        keeper.cancel()
        await Batch.objects.filter(id=batch_id).aupdate(lease_until=None)


async def _keep_lease(batch_id: str) -> None:
    while True:
        await asyncio.sleep(lease_secs() / 3)
        await Batch.objects.filter(id=batch_id).aupdate(lease_until=timezone.now() + timedelta(seconds=lease_secs()))


async def _run(batch: Batch, client: InferenceClient) -> dict[str, Any]:
    source = await StoredFile.objects.aget(id=batch.input_file_id)
    path = await sync_to_async(files.content_path)(source)
    lines = await asyncio.to_thread(batches.read_lines, path, batch.endpoint)
    written = await asyncio.to_thread(batches.written_results, batch.id)
    ok = sum(1 for result in written.values() if result["ok"])
    await Batch.objects.filter(id=batch.id).aupdate(completed=ok, failed=len(written) - ok)
    check = await sync_to_async(check_for_label)(batch.owner_label)
    handler = _LineHandler()
    stop: str | None = None
    model = ""

    async def stopped() -> str | None:
        """Why no more lines run: "cancelled" (the cancel flag), "expired" (the window ended)."""
        cancel, expires_at = (
            await Batch.objects.filter(id=batch.id).values_list("cancel_requested", "expires_at").aget()
        )
        if cancel:
            return "cancelled"
        return "expired" if timezone.now() >= expires_at else None

    with runtime.using(client), closing(handler):
        for line in batches.iter_pending(lines, set(written)):
            if stop := await stopped():
                break
            if line.model != model:
                model = line.model
                await Batch.objects.filter(id=batch.id).aupdate(current_model=model)
            answered = await _answer(handler, batch.endpoint, path, line, check, stopped)
            if answered is None:
                stop = await stopped() or "cancelled"
                break
            status, request_id, answer = answered
            succeeded = 200 <= status < 300
            output = batches.output_line(line.custom_id, status, request_id, answer)
            await asyncio.to_thread(batches.append_result, batch.id, line.index, succeeded, output)
            counter = "completed" if succeeded else "failed"
            await Batch.objects.filter(id=batch.id).aupdate(**{counter: F(counter) + 1})
    if stop is None and await stopped() == "cancelled":  # a cancel after the last line
        stop = "cancelled"
    if stop == "expired":
        expired = await asyncio.to_thread(batches.expire_rest, batch, lines)
        await Batch.objects.filter(id=batch.id).aupdate(failed=F("failed") + expired)
        log.info("batch %s expired with %d lines not run", batch.id, expired)
    await Batch.objects.filter(id=batch.id).aupdate(status="finalizing", finalizing_at=timezone.now(), current_model="")
    batch = await Batch.objects.aget(id=batch.id)
    output_id, error_id = await sync_to_async(batches.write_outputs)(batch, lines)
    outcome = stop or "completed"
    await Batch.objects.filter(id=batch.id).aupdate(
        status=outcome, output_file_id=output_id, error_file_id=error_id, **{f"{outcome}_at": timezone.now()}
    )
    await asyncio.to_thread(batches.results_path(batch.id).unlink, missing_ok=True)
    batch = await Batch.objects.aget(id=batch.id)
    return {"completed": batch.completed, "failed": batch.failed}


async def _answer(
    handler: ASGIHandler,
    endpoint: str,
    path: Path,
    line: batches.Line,
    check: KeyCheck,
    stopped: Callable[[], Awaitable[str | None]],
) -> tuple[int, str, Any] | None:
    """One line's status, request id and answer (None: stopped before it was answered)."""
    body = await asyncio.to_thread(batches.request_body, path, line)
    try:
        sent, content_type = await line_request(endpoint, body, check)
    except HypnosError as exc:  # its audio cannot be read: answered as the route answers a refusal
        return exc.status, "", exc.body()
    return await send_line(handler, endpoint, sent, check, stopped, content_type)
