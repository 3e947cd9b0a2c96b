"""The picture store of document conversions (spec §12): what a conversion with return_pictures
keeps, so that any web process can serve the pictures until they expire.

Records live in the database (StoredDocument, StoredPicture), the images in files under
`data_dir/pictures/<document id>/`. A request never names a file: it names a document id, which
must match DOCUMENT_ID_PATTERN exactly, and a picture index, and the file is the record's. A
document is seen only by the key that converted it and by admin keys; for any other key it does
not exist (404, so ids are not confirmed either). Expired documents are deleted lazily, by the
store's own calls at most every EXPIRE_EVERY_SECS, and by `manage.py expirepictures`.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, QuerySet, Sum
from django.utils import timezone

from hypnos_site.errors import InvalidRequest, NotFound
from logs.models import StoredDocument, StoredPicture
from logs.store import storable
from models_registry.authentication import ApiPrincipal

log = logging.getLogger(__name__)

# 128 random bits: an id cannot be guessed, only learnt from the conversion's response.
DOCUMENT_ID_PATTERN = r"doc-[0-9a-f]{32}"
_DOCUMENT_ID = re.compile(DOCUMENT_ID_PATTERN)
EXPIRE_EVERY_SECS = 5.0


class PictureNotStored(InvalidRequest):
    """A picture the store cannot keep: larger than the whole store, or its document left the
    store (deleted, expired, or the oldest when the store was full) while it was converted."""


def new_document_id() -> str:
    return "doc-" + secrets.token_hex(16)


def picture_url(document_id: str, index: int) -> str:
    return f"/v1/documents/{document_id}/pictures/{index}"


def iso_utc(moment: datetime) -> str:
    """A timestamp as the spec writes them: "2026-10-30T19:42:11Z"."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- writing (the conversion) ------------------------------------------------------------------


def create_document(document_id: str, *, owner: str | None, filename: str | None, model: str) -> StoredDocument:
    """Open a document for a conversion's pictures; it expires server.document_pictures_ttl_secs
    from now. `owner` is the converting key's label (None with no keys configured): labels name
    keys everywhere (quotas, the request log), and a config key has no database id."""
    _check_id(document_id)
    _expire_now_and_then()
    now = timezone.now()
    return StoredDocument.objects.create(
        id=document_id,
        owner_label=owner,
        filename=storable(filename or "")[:255],
        model=model,
        created_at=now,
        expires_at=now + timedelta(seconds=settings.HYPNOS.server.document_pictures_ttl_secs),
    )


def add_picture(
    document_id: str,
    *,
    index: int,
    page: int,
    png: bytes,
    width: int,
    height: int,
    dpi: int | None,
    bbox: dict[str, Any] | None,
    page_size: dict[str, Any] | None,
    caption: str | None,
    ref: str | None,
) -> StoredPicture:
    """Keep one picture of an open document. The oldest other documents are deleted first when
    the store would pass server.document_pictures_max_bytes; a picture that cannot fit even then
    is refused (PictureNotStored). The file is written whole under a temporary name and renamed
    before the record is committed, so a reader never finds a record without its whole file."""
    cap = settings.HYPNOS.server.document_pictures_max_bytes
    if len(png) > cap:
        raise PictureNotStored(
            f"Picture {index} (page {page}) is {len(png)} bytes, more than the whole picture store holds "
            f"(server.document_pictures_max_bytes = {cap}); convert without return_pictures.",
            param="return_pictures",
        )
    folder = _folder(document_id)
    _expire_now_and_then()
    with transaction.atomic():
        document = _open_document(document_id)
        _make_room(document, len(png), cap)
        temporary = _write_temporary(folder, png)
        try:
            picture = StoredPicture.objects.create(
                document=document,
                index=index,
                page=page,
                bytes=len(png),
                width=width,
                height=height,
                dpi=dpi,
                bbox=bbox,
                page_size=page_size,
                caption=storable(caption),
                ref=storable(ref),
                file=str(folder.relative_to(settings.HYPNOS.data_dir) / f"{index}.png"),
            )
            StoredDocument.objects.filter(id=document_id).update(total_bytes=F("total_bytes") + len(png))
            os.replace(temporary, folder / f"{index}.png")
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    return picture


def discard_document(document_id: str) -> None:
    """Remove a document's records and files, whatever state it is in (a failed or abandoned
    conversion leaves nothing behind); a document that is not there is no error."""
    _delete_documents([document_id])


def expire() -> int:
    """Delete the documents past their expiry, and folders no record owns that are older than the
    TTL (a process that died between writing a file and recording it); the count of documents."""
    expired = list(StoredDocument.objects.filter(expires_at__lte=timezone.now()).values_list("id", flat=True))
    _delete_documents(expired)
    _remove_orphan_folders()
    return len(expired)


# -- reading (the routes) ----------------------------------------------------------------------


def visible_documents(principal: ApiPrincipal | None) -> QuerySet[StoredDocument]:
    """The unexpired documents `principal` may see: all for admin keys and the open API (no key
    configured), the ones its own key converted for the others."""
    documents = StoredDocument.objects.filter(expires_at__gt=timezone.now())
    if principal is None or principal.admin:
        return documents
    return documents.filter(owner_label=principal.label)


def find_document(document_id: str, principal: ApiPrincipal | None) -> StoredDocument:
    _expire_now_and_then()
    document = visible_documents(principal).filter(id=document_id).first()
    if document is None:
        # Another key's document answers like a missing one: its id says nothing to this key.
        raise NotFound(f"No document has the id {document_id!r}; its pictures may have expired or been deleted.")
    return document


def find_picture(document_id: str, index: int, principal: ApiPrincipal | None) -> StoredPicture:
    document = find_document(document_id, principal)
    picture = document.pictures.filter(index=index).first()
    if picture is None:
        raise NotFound(f"Document {document_id!r} has no picture {index}; it has {document.pictures.count()}.")
    return picture


def list_pictures(document_id: str, principal: ApiPrincipal | None) -> dict[str, Any]:
    """The body of GET /v1/documents/{id}/pictures: the records without their images."""
    document = find_document(document_id, principal)
    return {
        "object": "list",
        "document_id": document.id,
        "expires_at": iso_utc(document.expires_at),
        "data": [picture_record(picture, with_image=False) for picture in document.pictures.all()],
    }


def picture_record(picture: StoredPicture, with_image: bool) -> dict[str, Any]:
    """A picture record (spec §12); caption and ref only when docling found them."""
    record: dict[str, Any] = {
        "object": "document.picture",
        "document_id": picture.document_id,
        "index": picture.index,
        "page": picture.page,
        "url": picture_url(picture.document_id, picture.index),
        "mime": picture.mime,
        "bytes": picture.bytes,
        "width": picture.width,
        "height": picture.height,
        "dpi": picture.dpi,
        "bbox": picture.bbox,
        "page_size": picture.page_size,
    }
    for name in ("caption", "ref"):
        if getattr(picture, name) is not None:
            record[name] = getattr(picture, name)
    if with_image:
        record["image"] = base64.b64encode(read_image(picture)).decode("ascii")
    return record


def read_image(picture: StoredPicture) -> bytes:
    try:
        return (settings.HYPNOS.data_dir / picture.file).read_bytes()
    except FileNotFoundError:
        # The document was deleted between reading its record and its file.
        raise NotFound(f"Picture {picture.index} of {picture.document_id!r} is no longer stored.") from None


def delete_document(document_id: str, principal: ApiPrincipal | None) -> None:
    """DELETE /v1/documents/{id}: only a key that sees the document may delete it."""
    discard_document(find_document(document_id, principal).id)


# -- the store's own parts ---------------------------------------------------------------------


def _root() -> Path:
    return settings.HYPNOS.data_dir / "pictures"


def _check_id(document_id: str) -> None:
    if not _DOCUMENT_ID.fullmatch(document_id):
        raise ValueError(f"not a picture store document id: {document_id!r}")


def _folder(document_id: str) -> Path:
    """The document's folder; the id is checked first, as every path is made from one."""
    _check_id(document_id)
    return _root() / document_id


def _open_document(document_id: str) -> StoredDocument:
    """The document being written, its row locked (PostgreSQL; SQLite writes one at a time
    anyway), so that a delete of it waits for this picture's record instead of racing it."""
    document = StoredDocument.objects.select_for_update().filter(id=document_id).first()
    if document is None:
        raise PictureNotStored(
            f"Document {document_id} left the picture store while it was converted: it was deleted, "
            "expired, or was the oldest when the store was full (server.document_pictures_max_bytes).",
            param="return_pictures",
        )
    return document


def _make_room(document: StoredDocument, incoming: int, cap: int) -> None:
    """Delete the oldest other documents until `incoming` more bytes fit under `cap`. Writers in
    two processes at once may each see room for themselves, so the cap can be passed by up to one
    picture per concurrent conversion until the next picture is added."""
    if document.total_bytes + incoming > cap:
        raise PictureNotStored(
            f"The pictures of {document.id} would take {document.total_bytes + incoming} bytes, more than the "
            f"whole picture store holds (server.document_pictures_max_bytes = {cap}); convert fewer pages "
            "or without return_pictures.",
            param="return_pictures",
        )
    excess = (StoredDocument.objects.aggregate(used=Sum("total_bytes"))["used"] or 0) + incoming - cap
    evicted: list[str] = []
    for older in StoredDocument.objects.exclude(id=document.id).order_by("created_at", "id").only("total_bytes"):
        if excess <= 0:
            break
        evicted.append(older.id)
        excess -= older.total_bytes
    if evicted:
        log.info("picture store full (%d bytes): deleting the oldest documents %s", cap, ", ".join(evicted))
        _delete_documents(evicted)


def _write_temporary(folder: Path, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".picture-", suffix=".tmp")
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return Path(name)


def _delete_documents(document_ids: list[str]) -> None:
    """Records first; the folders once that is committed, so a rolled-back transaction never
    leaves records whose files are gone."""
    folders = [_folder(document_id) for document_id in document_ids]
    if not folders:
        return
    StoredDocument.objects.filter(id__in=document_ids).delete()
    transaction.on_commit(lambda: _remove_folders(folders))


def _remove_folders(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _remove_orphan_folders() -> None:
    # Only folders older than the TTL: a younger one may belong to a document whose record is
    # not committed yet.
    root = _root()
    if not root.is_dir():
        return
    cutoff = time.time() - settings.HYPNOS.server.document_pictures_ttl_secs
    names = [p.name for p in root.iterdir() if _DOCUMENT_ID.fullmatch(p.name) and _modified_before(p, cutoff)]
    known = set(StoredDocument.objects.filter(id__in=names).values_list("id", flat=True))
    _remove_folders([root / name for name in names if name not in known])


def _modified_before(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime < cutoff
    except FileNotFoundError:  # another process removed it just now
        return False


class _Throttle:
    """True at most once per `every` seconds, across the threads of a process."""

    def __init__(self, every: float) -> None:
        self._every = every
        self._lock = threading.Lock()
        self._last = float("-inf")

    def due(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every:
                return False
            self._last = now
            return True


_expiry = _Throttle(EXPIRE_EVERY_SECS)


def _expire_now_and_then() -> None:
    if _expiry.due():
        expire()
