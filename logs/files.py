"""The file store of the Files API (POST /v1/files, OpenAI's; purpose "batch": a batch's input;
"user_data": what its lines name, the audio of transcriptions).

Records live in the database (StoredFile), the bytes in one file each under `data_dir/files/`,
named by the record's id. A request never names a path: it names a file id, which must match
FILE_ID_PATTERN exactly. A file is seen only by the key that uploaded it and by admin keys; for
any other key it does not exist (404, so ids are not confirmed either). An upload is written to
a temporary file beside its final place, checked, then renamed and recorded: a failed or refused
upload leaves neither a record nor bytes behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import QuerySet, Sum
from django.utils import timezone

from hypnos_site.errors import InvalidRequest, NotFound
from hypnos_site.json_bodies import too_many_values
from logs.listing import owned_by, page
from logs.models import StoredFile
from models_registry.authentication import ApiPrincipal

log = logging.getLogger(__name__)

# 128 random bits: an id cannot be guessed, only learnt from the upload's answer or a listing.
FILE_ID_PATTERN = r"file-[0-9a-f]{32}"
_FILE_ID = re.compile(FILE_ID_PATTERN)
# What a client may upload a file for: the Batch API's input (JSONL, checked), and OpenAI's
# "user_data" (any bytes: the audio a batch's transcription lines name by file id). OpenAI's
# other purposes name assistants, fine-tuning and evals, which Hypnos does not serve.
PURPOSES = ("batch", "user_data")
# OpenAI's bound on a batch's requests.
MAX_BATCH_LINES = 50_000
LIST_LIMIT_MAX = 10_000


def new_file_id() -> str:
    return "file-" + secrets.token_hex(16)


def file_object(row: StoredFile) -> dict[str, Any]:
    """OpenAI's File object."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(row.created_at.timestamp()),
        "expires_at": None,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


# -- writing -------------------------------------------------------------------------------------


def store_upload(
    chunks: Iterable[bytes], *, size: int, filename: str, purpose: str, owner: str | None
) -> dict[str, Any]:
    """POST /v1/files: the upload's bytes kept as a new file of `owner`; its File object.
    Refused (400, nothing kept) when the purpose is not one Hypnos serves, the file is larger
    than server.files_max_bytes or than what is left of the key's server.files_max_bytes_per_key,
    or a batch input is not JSONL of objects (the first bad line named)."""
    config = settings.HYPNOS.server
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(PURPOSES)} (the Batch API's input and the files its lines name), "
            f"not {purpose!r}.",
            param="purpose",
        )
    if size > config.files_max_bytes:
        raise InvalidRequest(
            f"The file is {size} bytes, above server.files_max_bytes ({config.files_max_bytes}).", param="file"
        )
    used = StoredFile.objects.filter(owner_label=owner).aggregate(used=Sum("bytes"))["used"] or 0
    if used + size > config.files_max_bytes_per_key:
        raise InvalidRequest(
            f"The key's files take {used} bytes; this one's {size} more would pass "
            f"server.files_max_bytes_per_key ({config.files_max_bytes_per_key}). Delete files first.",
            param="file",
        )
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=root, prefix=".upload-", suffix=".tmp")
    temporary = Path(name)
    try:
        written = 0
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                written += len(chunk)
                if written > config.files_max_bytes:  # a client that sent more than it declared
                    raise InvalidRequest(
                        f"The file is above server.files_max_bytes ({config.files_max_bytes}).", param="file"
                    )
                out.write(chunk)
        if purpose == "batch":
            check_batch_lines(temporary)
        file_id = new_file_id()
        final = root / file_id
        os.replace(temporary, final)
        try:
            row = StoredFile.objects.create(
                id=file_id,
                owner_label=owner,
                purpose=purpose,
                filename=filename[:255],
                bytes=written,
                created_at=timezone.now(),
                file=str(final.relative_to(settings.HYPNOS.data_dir)),
            )
        except BaseException:
            final.unlink(missing_ok=True)
            raise
    finally:
        temporary.unlink(missing_ok=True)
    return file_object(row)


def new_temporary() -> Path:
    """An empty temporary file in the store's folder, for the server to write a file into and
    then keep with keep_written (a batch's output)."""
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=root, prefix=".output-", suffix=".tmp")
    os.close(fd)
    return Path(name)


def keep_written(temporary: Path, *, filename: str, purpose: str, owner: str | None) -> StoredFile:
    """A file the server wrote (new_temporary) kept as a file of `owner`: renamed into place,
    then recorded; the key's byte bound does not refuse it (it is the answer to work it asked)."""
    file_id = new_file_id()
    final = _root() / file_id
    os.replace(temporary, final)
    try:
        return StoredFile.objects.create(
            id=file_id,
            owner_label=owner,
            purpose=purpose,
            filename=filename,
            bytes=final.stat().st_size,
            created_at=timezone.now(),
            file=str(final.relative_to(settings.HYPNOS.data_dir)),
        )
    except BaseException:
        final.unlink(missing_ok=True)
        raise


def check_batch_lines(path: Path) -> None:
    """A batch input: UTF-8 JSONL, every non-blank line a JSON object, at most MAX_BATCH_LINES
    of them. Read a line at a time; each line's nesting is bounded before it is parsed."""
    lines = 0
    with path.open("rb") as source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            lines += 1
            if lines > MAX_BATCH_LINES:
                raise InvalidRequest(f"A batch holds at most {MAX_BATCH_LINES} requests.", param="file")
            problem = too_many_values(raw)
            try:
                value = json.loads(raw) if problem is None else None
            except ValueError as exc:
                problem = f"it is not JSON ({exc})"
            if problem is None and not isinstance(value, dict):
                problem = "it is not a JSON object"
            if problem is not None:
                raise InvalidRequest(f"Line {number} of the batch file is refused: {problem}.", param="file")
    if lines == 0:
        raise InvalidRequest("The batch file holds no request.", param="file")


# -- reading -------------------------------------------------------------------------------------


def visible_files(principal: ApiPrincipal | None) -> QuerySet[StoredFile]:
    return owned_by(StoredFile.objects.all(), principal)


def find_file(file_id: str, principal: ApiPrincipal | None) -> StoredFile:
    row = visible_files(principal).filter(id=file_id).first() if _FILE_ID.fullmatch(file_id) else None
    if row is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return row


def list_files(
    principal: ApiPrincipal | None, *, purpose: str | None, limit: int, after: str | None, order: str
) -> dict[str, Any]:
    """GET /v1/files: OpenAI's page of File objects, newest first by default; `after` is the
    last id of the previous page."""
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequest(f"limit must be between 1 and {LIST_LIMIT_MAX}.", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc.", param="order")
    files = visible_files(principal)
    if purpose:
        files = files.filter(purpose=purpose)
    cursor = find_file(after, principal) if after else None
    return page(files, limit=limit, after=cursor, ascending=order == "asc", render=file_object)


def content_path(row: StoredFile) -> Path:
    """The file's bytes on disk (the record's own path, never one a request named)."""
    path = settings.HYPNOS.data_dir / row.file
    if not path.is_file():
        raise NotFound(f"The content of {row.id} is gone from the store.", param="file_id")
    return path


async def read_chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """The file's bytes, a chunk at a time off the event loop: a response streams them, never
    holding more than one chunk (Django's ASGI handler would read a plain file whole first)."""
    with path.open("rb") as source:
        while chunk := await asyncio.to_thread(source.read, size):
            yield chunk


def delete_file(file_id: str, principal: ApiPrincipal | None) -> dict[str, Any]:
    """DELETE /v1/files/{id}: only a key that sees the file may delete it; the record goes
    first, then the bytes."""
    row = find_file(file_id, principal)
    path = settings.HYPNOS.data_dir / row.file
    row.delete()
    path.unlink(missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}


def _root() -> Path:
    return settings.HYPNOS.data_dir / "files"
