"""POST /v1/documents/convert (spec §12): the request's checks, the upload spooled, the job handed
to Celery, and its progress relayed to the client as JSON or as SSE events.

Every refusal comes before the first byte: the web process checks the fields, the models and the
upload's size here; the job's first event (`document_opened`, once the worker has read the
document and checked the pages) or its error decides the status. A client that leaves sets the
job's cancel flag; the job stops at its next page."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.errors import TOO_LARGE, HypnosError, InvalidRequest, ModelNotAvailable
from inference.jobs import feed as jobs
from inference.jobs.documents import ConversionSpec
from inference.jobs.feed import JobFeed
from inference.transport.client import InferenceClient
from inference.transport.wire import DocumentOpened, Done, PageReady
from inference.web.common import image_input
from inference.web.common.context import RequestContext, resolve_model
from inference.web.common.pool import pool
from inference.web.common.protocol import parse_body
from inference.web.common.render import DONE, sse_data, sse_error, sse_response
from inference.web.openai.protocol_media import FORM_FALSE, FORM_TRUE, DocumentConvertRequest
from logs.models import DocumentJob
from logs.record import CallRecord

log = logging.getLogger(__name__)
FORM_FIELDS = ("model", "url", "filename", "pages", "output_format", "describe_pictures", "file")
FORM_BOOLEANS = ("ocr", "stream", "return_pictures")
SPOOL_CHUNK = 1 << 20


async def convert_document(
    client: InferenceClient, data: Any, ctx: RequestContext, owner: str | None
) -> HttpResponseBase:
    body, upload = document_request(data)
    model = await resolve_model(client, body.model, ctx)
    ctx.record.work = "document"
    if model.modality != "document_conversion":
        raise InvalidRequest(f"The model {model.id!r} serves {model.modality}, not document_conversion.", param="model")
    if body.describe_pictures:
        await _check_vision_model(client, body.describe_pictures)
    path = await _spool(body, upload, ctx.request_id)
    job_id = "job-" + uuid.uuid4().hex

    async def create_row(channel: str) -> None:
        spec = ConversionSpec(
            model=model.id,
            path=str(path),
            filename=body.filename or _name_of(upload, body.url),
            pages=body.pages,
            ocr=body.ocr,
            output_format=body.output_format,
            describe_pictures=body.describe_pictures,
            return_pictures=body.return_pictures,
            owner=owner,
            progress_channel=channel,
            max_pages=settings.HYPNOS.limits.max_document_pages,
        )
        await DocumentJob.objects.acreate(
            id=job_id,
            request_id=ctx.request_id,
            model=model.id,
            filename=spec.filename or "",
            owner=owner or "",
            spec=spec.model_dump(),
        )

    from inference.jobs.tasks import convert_document

    feed, opened = await jobs.start(DocumentJob, job_id, convert_document, create_row, DocumentOpened, [path])
    if body.stream:
        return sse_response(_document_sse(feed, job_id, opened, ctx.record))
    return JsonResponse(await _document_json(feed, job_id, ctx.record))


def document_request(data: Any) -> tuple[DocumentConvertRequest, Any]:
    """The fields and, for multipart, the uploaded `file` part."""
    if hasattr(data, "getlist"):
        upload = data.get("file")
        fields: dict[str, Any] = {k: data.get(k) for k in FORM_FIELDS if data.get(k) not in (None, "")}
        if hasattr(upload, "read"):
            fields.pop("file", None)
        else:
            upload = None
        for name in FORM_BOOLEANS:
            if data.get(name) not in (None, ""):
                fields[name] = _form_bool(name, data.get(name))
        body = parse_body(DocumentConvertRequest, fields)
    elif isinstance(data, dict):
        upload = None
        body = parse_body(DocumentConvertRequest, dict(data))
    else:
        raise InvalidRequest("The request body must be multipart/form-data or a JSON object.")
    given = sum(x is not None for x in (upload, body.file, body.url))
    if given != 1:
        raise InvalidRequest("Send the document as exactly one of `file` or `url`.", param="file")
    return body, upload


def _form_bool(name: str, value: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in FORM_TRUE:
        return True
    if lowered in FORM_FALSE:
        return False
    raise InvalidRequest(f"{name} must be true or false (also 1/0, yes/no, on/off), not {value!r}.", param=name)


async def _check_vision_model(client: InferenceClient, name: str) -> None:
    await pool.ensure(client, name)
    try:
        vision = pool.find(name)
    except HypnosError:
        raise InvalidRequest(
            f"describe_pictures names {name!r}, which is no model of the pool.", param="describe_pictures"
        ) from None
    if "vision" not in vision.modalities:
        raise InvalidRequest(
            f"describe_pictures needs a vision model; {vision.id!r} serves {', '.join(vision.modalities)}.",
            param="describe_pictures",
        )


def _name_of(upload: Any, url: str | None) -> str | None:
    """The document's name from its part or its URL: a plain name of at most 255 characters
    (a URL's %00 or an endless last segment never reach the job's row)."""
    name = ""
    if upload is not None:
        name = Path(getattr(upload, "name", "") or "").name
    elif url:
        name = Path(unquote(urlsplit(url).path)).name
    name = "".join(ch for ch in name if ch.isprintable())[-255:]
    return name or None


async def _spool(body: DocumentConvertRequest, upload: Any, request_id: str) -> Path:
    """The document in a spool file the job reads and removes, at most max_document_bytes."""
    limit = settings.HYPNOS.limits.max_document_bytes
    spool = settings.HYPNOS.data_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{request_id}-{uuid.uuid4().hex[:8]}.document"
    if upload is not None:
        if upload.size > limit:
            raise _too_large(upload.size, limit)
        if upload.size == 0:
            raise InvalidRequest("The document is empty (0 bytes).", param="file")
        await asyncio.to_thread(_write_upload, upload, path)
        return path
    if body.file is not None:
        data = _decode_inline(body.file, limit)
    else:
        assert body.url is not None
        data = await _fetch(body.url, limit)
    if len(data) > limit:
        raise _too_large(len(data), limit)
    if not data:
        raise InvalidRequest("The document is empty (0 bytes).", param="url" if body.url else "file")
    await asyncio.to_thread(path.write_bytes, data)
    return path


def _write_upload(upload: Any, path: Path) -> None:
    with open(path, "wb") as out:
        for chunk in upload.chunks(SPOOL_CHUNK):
            out.write(chunk)


def _decode_inline(text: str, limit: int) -> bytes:
    """`file` in JSON: base64, or a data: URI holding base64."""
    payload = text
    if text.startswith("data:"):
        header, comma, payload = text[len("data:") :].partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise InvalidRequest("file as a data: URI must be base64 (data:<type>;base64,<data>).", param="file")
    if len(payload) * 3 // 4 > limit + 3:
        raise _too_large(len(payload) * 3 // 4, limit)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("file is not valid base64 (nor a data: URI holding base64).", param="file") from None


async def _fetch(url: str, limit: int) -> bytes:
    """The document at `url`, under the same rules as chat image URLs (private, loopback,
    link-local and metadata addresses refused, also after a redirect)."""
    limits = settings.HYPNOS.limits
    if not limits.allow_remote_image_urls:
        raise InvalidRequest(
            "Remote URLs are turned off on this server (limits.allow_remote_image_urls); upload the file.",
            param="url",
        )
    policy = dataclasses.replace(
        image_input.ImagePolicy.from_limits(limits),
        max_bytes=limit,
        param="url",
        noun="document",
        limit_name="limits.max_document_bytes",
        accept="*/*",
        too_large=lambda message: InvalidRequest(message, param="url", code=TOO_LARGE),
    )
    return await image_input.fetch(url, policy)


def _too_large(size: int, limit: int) -> InvalidRequest:
    """Spec §1: a limit of the section exceeded is a 400 (the 413 is max_body_bytes's alone)."""
    message = f"The document is {size} bytes, above limits.max_document_bytes ({limit})."
    return InvalidRequest(message, param="file", code=TOO_LARGE)


def _job_events(feed: JobFeed, job_id: str, record: CallRecord) -> AsyncGenerator[Any, None]:
    """The job's events after `document_opened` up to its Done; leaving early cancels the job."""
    return jobs.job_events(feed, DocumentJob, job_id, record)


def _document_of(done: Done) -> dict[str, Any]:
    """The converted document's body the job sent in its Done."""
    return done.result if isinstance(done.result, dict) else {}


async def _document_json(feed: JobFeed, job_id: str, record: CallRecord) -> dict[str, Any]:
    pages: list[dict[str, Any]] = []
    async with aclosing(_job_events(feed, job_id, record)) as events:
        async for event in events:
            if isinstance(event, PageReady):
                pages.append(event.page)
            elif isinstance(event, Done):
                return {**_document_of(event), "pages": pages}
    raise ModelNotAvailable("the job ended without its document")


async def _document_sse(feed: JobFeed, job_id: str, opened: DocumentOpened, record: CallRecord) -> AsyncIterator[str]:
    """document.started, one document.page per page as it is ready, document, [DONE]; an
    error after the start is an `error` event, then [DONE]."""
    started: dict[str, Any] = {"object": "document.started", "page_count": opened.page_count, "pages": opened.pages}
    if opened.document_id:
        started["id"] = opened.document_id
    yield sse_data(started)
    try:
        async with aclosing(_job_events(feed, job_id, record)) as events:
            async for event in events:
                if isinstance(event, PageReady):
                    yield sse_data({"object": "document.page", **event.page})
                elif isinstance(event, Done):
                    yield sse_data(_document_of(event) or {"object": "document"})
        yield DONE
    except HypnosError as error:
        yield sse_error(error, {"object": "error"}, record)
