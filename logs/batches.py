"""The batches of the Batch API (OpenAI's POST /v1/batches): their rows, their checks, their
results and their output files.

A batch is created from an input file of the Files API (logs/files.py), every line checked
first: a line that is not a request to the batch's endpoint refuses the whole batch, naming the
line (400, nothing created). The job (inference/jobs/batches.py) appends one result a line to
`data_dir/batches/<id>.jsonl` as each request ends, so a job that starts again (a restarted
Celery worker or server) skips what is written and does nothing twice; at the end the results
become the output file (2xx answers) and the error file (the others), in input order. A batch
is seen only by the key that created it and by admin keys.

A batch not finished when its completion window ends is expired (OpenAI's semantics): the lines
not run yet go to the error file as `batch_expired`, the answered ones stay where they are.

A line of /v1/audio/transcriptions names its audio in `body.file`: the id of a file of the
Files API the batch's key sees, or a data: URL; the job sends it to the route as the multipart
upload the route takes from a client (line_audio).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from hypnos_site.errors import HypnosError, InvalidRequest, NotFound
from logs import files
from logs.listing import owned_by, page
from logs.models import Batch
from models_registry.authentication import ApiPrincipal

BATCH_ID_PATTERN = r"batch_[0-9a-f]{32}"
_BATCH_ID = re.compile(BATCH_ID_PATTERN)
TRANSCRIPTIONS = "/v1/audio/transcriptions"
# The routes a batch line may call: JSON bodies (a transcription's audio named in it, sent as the
# route's multipart upload), answered in one JSON object (a text transcript: a JSON string).
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/entities",
    TRANSCRIPTIONS,
)
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
TERMINAL = ("completed", "failed", "cancelled", "expired")
MAX_CUSTOM_ID_CHARS = 512
# A line's audio given inline: a base64 data: URL of one of these media types.
_DATA_URL = re.compile(r"data:((?:audio|video)/[\w.+-]+|application/octet-stream)(?:;[\w.+-]+=[\w.+-]+)*;base64,")
# OpenAI's error-file line for a request the completion window ended before.
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class Line:
    """One request of a batch's input: its 0-based index, where it lies in the file, and what
    the job needs to order and run it."""

    index: int
    custom_id: str
    model: str
    offset: int
    length: int


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


def _stamp(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_object(batch: Batch) -> dict[str, Any]:
    """OpenAI's Batch object, with what Hypnos adds: the model a running batch holds."""
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": _stamp(batch.created_at),
        "in_progress_at": _stamp(batch.in_progress_at),
        "expires_at": _stamp(batch.expires_at),
        "finalizing_at": _stamp(batch.finalizing_at),
        "completed_at": _stamp(batch.completed_at),
        "failed_at": _stamp(batch.failed_at),
        "expired_at": _stamp(batch.expired_at),
        "cancelling_at": _stamp(batch.cancelling_at),
        "cancelled_at": _stamp(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
        "hypnos_current_model": batch.current_model or None,
    }


# -- creating ------------------------------------------------------------------------------------


def create_batch(
    principal: ApiPrincipal | None,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    """POST /v1/batches: the input file read line by line and every line checked, then the row
    (status in_progress, its total set); the caller hands it to the job."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}.", param="endpoint")
    window = COMPLETION_WINDOWS.get(completion_window)
    if window is None:
        raise InvalidRequest(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}.", param="completion_window"
        )
    source = files.find_file(input_file_id, principal)
    if source.purpose != "batch":
        raise InvalidRequest(f"{input_file_id} was uploaded for {source.purpose}, not batch.", param="input_file_id")
    lines = read_lines(files.content_path(source), endpoint, lambda file_id: files.find_file(file_id, principal))
    now = timezone.now()
    override = settings.HYPNOS.server.batch_window_secs
    if override is not None:  # a test's or an operator's window; the public value stays the same
        window = timedelta(seconds=override)
    return Batch.objects.create(
        id=new_batch_id(),
        owner_label=principal.label if principal is not None else None,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        metadata=metadata,
        status="in_progress",
        total=len(lines),
        created_at=now,
        in_progress_at=now,
        expires_at=now + window,
    )


def read_lines(path: Path, endpoint: str, find_file: Callable[[str], object] | None = None) -> list[Line]:
    """Every request of an input file, checked: a JSON object with a unique string `custom_id`,
    `method` POST, `url` the batch's endpoint and a `body` object naming its `model` and not
    asking for a stream; a transcription's `body.file` a data: URL of audio or a file id that
    `find_file` finds (given when the batch is created: a file the key sees; the job reading the
    lines again gives none). The first line that is not is a 400 naming it."""
    lines: list[Line] = []
    seen: set[str] = set()
    offset = 0
    with path.open("rb") as source:
        for number, raw in enumerate(source, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            problem, line = _check_line(raw, endpoint, seen)
            if problem is None and endpoint == TRANSCRIPTIONS and line is not None:
                problem = _audio_problem(line["body"], find_file)
            if problem is not None:
                raise InvalidRequest(f"Line {number} of the input file is refused: {problem}.", param="input_file_id")
            assert line is not None
            seen.add(line["custom_id"])
            lines.append(Line(len(lines), line["custom_id"], line["body"]["model"], start, len(raw)))
    if not lines:
        raise InvalidRequest("The input file holds no request.", param="input_file_id")
    return lines


def _check_line(raw: bytes, endpoint: str, seen: set[str]) -> tuple[str | None, dict[str, Any] | None]:
    try:
        line = json.loads(raw)
    except ValueError as exc:
        return f"it is not JSON ({exc})", None
    if not isinstance(line, dict):
        return "it is not a JSON object", None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters", None
    if custom_id in seen:
        return f"custom_id {custom_id!r} is used by an earlier line", None
    if line.get("method") != "POST":
        return "method must be POST", None
    if line.get("url") != endpoint:
        return f"url must be the batch's endpoint {endpoint}, not {line.get('url')!r}", None
    body = line.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object", None
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "body.model must name a model", None
    if body.get("stream"):
        return "body.stream must not be true: a batch's answers are whole", None
    return None, line


def _audio_problem(body: dict[str, Any], find_file: Callable[[str], object] | None) -> str | None:
    """Why a transcription line's `body.file` names no audio, or None: a data: URL must decode,
    a file id must be found by `find_file` (when given)."""
    reference = body.get("file")
    if not isinstance(reference, str) or not reference:
        return "body.file must name the audio: a file id or a data: URL"
    try:
        if reference.startswith("data:"):
            data_url_bytes(reference)
        elif find_file is not None:
            find_file(reference)
    except HypnosError as exc:
        return f"body.file: {exc.message.rstrip('.')}"
    return None


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 data: URL of audio (or video, or octet-stream); 400 otherwise."""
    match = _DATA_URL.match(url)
    if match is None:
        raise InvalidRequest("A data: URL must read data:<audio/... or video/... type>;base64,<data>.", param="file")
    try:
        data = base64.b64decode(url[match.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("The data: URL does not hold valid base64.", param="file") from None
    if not data:
        raise InvalidRequest("The data: URL holds no audio.", param="file")
    return data


def line_audio(body: dict[str, Any], principal: ApiPrincipal | None) -> tuple[bytes, str]:
    """A transcription line's audio and its file name, read when the line runs: the data: URL's
    bytes, or the bytes of the file `principal` still sees (404 when it was deleted since)."""
    reference = str(body.get("file") or "")
    if reference.startswith("data:"):
        return data_url_bytes(reference), "audio"
    row = files.find_file(reference, principal)
    return files.content_path(row).read_bytes(), row.filename


def request_body(path: Path, line: Line) -> bytes:
    """The `body` of one line, read from the input file at `path` again (the job keeps only
    offsets)."""
    with path.open("rb") as handle:
        handle.seek(line.offset)
        raw = handle.read(line.length)
    return json.dumps(json.loads(raw)["body"]).encode()


# -- reading -------------------------------------------------------------------------------------


def visible_batches(principal: ApiPrincipal | None) -> QuerySet[Batch]:
    return owned_by(Batch.objects.all(), principal)


def find_batch(batch_id: str, principal: ApiPrincipal | None) -> Batch:
    batch = visible_batches(principal).filter(id=batch_id).first() if _BATCH_ID.fullmatch(batch_id) else None
    if batch is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return batch


def list_batches(principal: ApiPrincipal | None, *, limit: int, after: str | None) -> dict[str, Any]:
    """GET /v1/batches: newest first; `after` is the last id of the previous page."""
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100.", param="limit")
    cursor = find_batch(after, principal) if after else None
    return page(visible_batches(principal), limit=limit, after=cursor, ascending=False, render=batch_object)


def cancel_batch(batch_id: str, principal: ApiPrincipal | None) -> Batch:
    """POST /v1/batches/{id}/cancel: cancelling until the job sees it (before its next line),
    then cancelled with the results so far. A batch that has ended stays as it is."""
    batch = find_batch(batch_id, principal)
    if batch.status in (*TERMINAL, "finalizing"):
        return batch
    Batch.objects.filter(id=batch.id).update(cancel_requested=True, status="cancelling", cancelling_at=timezone.now())
    batch.refresh_from_db()
    return batch


def fail(batch_id: str, reason: str) -> None:
    """The batch could not be handed to its job (no job broker): failed, with the reason."""
    Batch.objects.filter(id=batch_id).update(
        status="failed",
        failed_at=timezone.now(),
        errors=[{"code": "server_error", "message": reason, "param": None, "line": None}],
    )


def expire_rest(batch: Batch, lines: list[Line]) -> int:
    """The window ended: every line with no result yet gets OpenAI's `batch_expired` error
    line, written like any result (a job started again finds them done); how many."""
    written = written_results(batch.id)
    pending = [(line.index, False, expired_line(line.custom_id)) for line in lines if line.index not in written]
    append_results(batch.id, pending)
    return len(pending)


def expired_line(custom_id: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(16),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE},
    }


# -- results -------------------------------------------------------------------------------------


def results_path(batch_id: str) -> Path:
    if not _BATCH_ID.fullmatch(batch_id):
        raise ValueError(f"not a batch id: {batch_id!r}")
    return settings.HYPNOS.data_dir / "batches" / f"{batch_id}.jsonl"


def written_results(batch_id: str) -> dict[int, dict[str, Any]]:
    """The results the job has written, by line index. A last line cut short by a crash is
    not a result: its request runs again."""
    path = results_path(batch_id)
    found: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return found
    with path.open("rb") as source:
        for raw in source:
            try:
                result = json.loads(raw)
            except ValueError:
                break
            found[result["index"]] = result
    return found


def append_result(batch_id: str, index: int, ok: bool, output: dict[str, Any]) -> None:
    """One line's result, on disk before the next request starts (written and synced)."""
    append_results(batch_id, [(index, ok, output)])


def append_results(batch_id: str, results: list[tuple[int, bool, dict[str, Any]]]) -> None:
    """Lines' results (index, answered 2xx, output line), written and synced once."""
    path = results_path(batch_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as out:
        for index, ok, output in results:
            out.write(json.dumps({"index": index, "ok": ok, "output": output}).encode() + b"\n")
        out.flush()
        os.fsync(out.fileno())


def output_line(custom_id: str, status: int, request_id: str, body: Any) -> dict[str, Any]:
    """OpenAI's output line: the answer as the route gave it."""
    return {
        "id": "batch_req_" + secrets.token_hex(16),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def write_outputs(batch: Batch, lines: list[Line]) -> tuple[str, str]:
    """The output file (2xx answers) and the error file (the others), each in input order, kept
    as files of the batch's key; their ids ("" for one with no line)."""
    results = written_results(batch.id)
    ids = []
    for ok in (True, False):
        chosen = [
            results[line.index]["output"] for line in lines if line.index in results and results[line.index]["ok"] is ok
        ]
        if not chosen:
            ids.append("")
            continue
        temporary = files.new_temporary()
        with temporary.open("wb") as out:
            for output in chosen:
                out.write(json.dumps(output, ensure_ascii=False).encode() + b"\n")
        kind = "output" if ok else "errors"
        kept = files.keep_written(
            temporary, filename=f"{batch.id}_{kind}.jsonl", purpose="batch_output", owner=batch.owner_label
        )
        ids.append(kept.id)
    return ids[0], ids[1]


def iter_pending(lines: list[Line], done: set[int]) -> Iterator[Line]:
    """The lines still to run, grouped by model (each model promoted once, in the order its first
    line comes), in input order within a model."""
    first_seen: dict[str, int] = {}
    for line in lines:
        first_seen.setdefault(line.model, line.index)
    for line in sorted(lines, key=lambda item: (first_seen[item.model], item.index)):
        if line.index not in done:
            yield line
