"""The document conversion job (spec §12), run by the Celery task `convert_document`.

It calls the inference worker through the process's InferenceClient like a view does: the
docling model converts page by page; for each page the job describes the pictures with the
vision model the request named, keeps them in the picture store when asked, and sends the page
to the waiting request at once. At the end it joins the pages' Markdown (mending what the page
breaks cut) and sends the document. The job's row (logs.models.DocumentJob) says what it is doing
for the operator; a client that left sets its cancel flag, and the job stops at the next page.

Nothing is left behind whatever the ending: the spool file and the pictures' PNGs are removed,
and a failed or cancelled job's stored pictures are discarded."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone
from pydantic import BaseModel, ConfigDict

from hypnos_site.errors import Cancelled, HypnosError, ServerError
from inference.jobs.feed import JobReporter, watched
from inference.jobs.markdown_join import join_pages
from inference.transport.client import InferenceClient, new_request_id
from inference.transport.wire import (
    IMAGE_MARKER,
    DocumentOpened,
    DocumentPage,
    DocumentWork,
    Done,
    EngineRequest,
    GenerateWork,
    PageReady,
)
from logs import pictures
from logs.models import DocumentJob

log = logging.getLogger(__name__)

PLACEHOLDER = "<!-- image -->"
DESCRIBE_PROMPT = "Describe this picture from a document in one or two sentences."
DESCRIBE_MAX_TOKENS = 96
# The job's row says how many pages are done at most this often while it runs (a row update per
# text page cost about a millisecond of its five), and exactly once it has ended.
PROGRESS_SAVE_SECS = 0.5


class ConversionSpec(BaseModel):
    """What the request asked for, as the web process hands it to the job (kept in the job row)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    model: str
    path: str
    filename: str | None = None
    pages: str | None = None
    ocr: bool = True
    output_format: Literal["markdown", "json"] = "markdown"
    describe_pictures: str | None = None
    return_pictures: bool = False
    # The label of the API key that asked (None: the open API): the stored pictures are its own.
    owner: str | None = None
    progress_channel: str
    max_pages: int


async def run_job(job_id: str, client: InferenceClient, layer: Any) -> dict[str, Any] | None:
    """Run the job to its end, reporting on `layer` (inference/jobs/feed.py); the document (with its
    pages) is the task's stored result."""
    job = await DocumentJob.objects.aget(pk=job_id)
    spec = ConversionSpec.model_validate(job.spec)
    reporter = JobReporter(layer, spec.progress_channel)
    picture_dir = _picture_dir(job_id) if spec.return_pictures or spec.describe_pictures else None
    conversion: _Conversion | None = None
    try:
        if job.cancel_requested:
            raise Cancelled("the client left before the job started")
        await _set(job, state="running", started_at=timezone.now())
        conversion = _Conversion(job, spec, client, reporter, picture_dir)
        document = await watched(DocumentJob, job_id, conversion.run(), reporter)
        # The row is final before the client hears the end.
        await _set(job, state="done", pages_done=len(conversion.pages), finished_at=timezone.now())
        await reporter.send(Done(result=document, telemetry=document["hypnos_telemetry"]))
        return {**document, "pages": conversion.pages}
    except (asyncio.CancelledError, Cancelled):
        await _set(job, state="cancelled", pages_done=_pages_done(conversion), finished_at=timezone.now())
        await _discard(job)
        return None
    except Exception as exc:
        if isinstance(exc, HypnosError):
            error = exc
        else:
            log.exception("document job %s failed", job_id)
            error = ServerError(f"The conversion failed: {type(exc).__name__}: {exc}")
        await _set(
            job,
            state="failed",
            error=error.message[:2000],
            pages_done=_pages_done(conversion),
            finished_at=timezone.now(),
        )
        await _discard(job)
        await reporter.error(error)
        return None
    finally:
        Path(spec.path).unlink(missing_ok=True)
        if picture_dir is not None:
            shutil.rmtree(picture_dir, ignore_errors=True)


class _Conversion:
    def __init__(
        self,
        job: DocumentJob,
        spec: ConversionSpec,
        client: InferenceClient,
        reporter: JobReporter,
        picture_dir: Path | None,
    ):
        self.job, self.spec, self.client, self.reporter = job, spec, client, reporter
        self.picture_dir = picture_dir
        self.document_id: str | None = None
        self.expires_at: str | None = None
        self.pages: list[dict[str, Any]] = []
        self.picture_count = 0
        self.described = 0
        self.progress_saved_at = 0.0

    async def run(self) -> dict[str, Any]:
        """Convert, page by page; the document without its pages (they went out one by one)."""
        spec = self.spec
        if self.picture_dir is not None:
            self.picture_dir.mkdir(parents=True, exist_ok=True)
        work = DocumentWork(
            path=spec.path,
            filename=spec.filename,
            pages=spec.pages,
            ocr=spec.ocr,
            want_json=spec.output_format == "json",
            picture_dir=str(self.picture_dir) if self.picture_dir else None,
            max_pages=spec.max_pages,
        )
        request = EngineRequest(request_id=self.job.request_id, model=spec.model, work=work)
        started = time.perf_counter()
        call, _started = await self.client.start(request)
        done: Done | None = None
        opened: DocumentOpened | None = None
        async with call:
            async for event in call.events():
                if isinstance(event, DocumentOpened):
                    opened = await self._opened(event)
                elif isinstance(event, DocumentPage):
                    await self._page(event)
                elif isinstance(event, Done):
                    done = event
        if done is None or opened is None:
            raise ServerError("the inference worker ended the conversion without its result")
        return self._document(opened, done, (time.perf_counter() - started) * 1000)

    async def _opened(self, event: DocumentOpened) -> DocumentOpened:
        if self.spec.return_pictures:
            self.document_id = pictures.new_document_id()
            stored = await sync_to_async(pictures.create_document)(
                self.document_id, owner=self.spec.owner, filename=self.spec.filename, model=self.spec.model
            )
            self.expires_at = stored.expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")
            await _set(self.job, document_id=self.document_id)
        await _set(self.job, pages_total=len(event.pages))
        opened = DocumentOpened(
            page_count=event.page_count,
            pages=event.pages,
            format=event.format,
            pipeline=event.pipeline,
            document_id=self.document_id,
        )
        await self.reporter.send(opened)
        return opened

    async def _page(self, event: DocumentPage) -> None:
        markdown = event.markdown
        urls = []
        descriptions = []
        first = self.picture_count + 1
        self.picture_count += event.picture_count
        for number, picture in enumerate(event.pictures, start=first):
            png = Path(picture.path).read_bytes()
            if self.spec.describe_pictures:
                descriptions.append(await self._describe(png))
            if self.document_id is not None:
                await sync_to_async(pictures.add_picture)(
                    self.document_id,
                    index=number,
                    page=event.page,
                    png=png,
                    width=picture.width,
                    height=picture.height,
                    dpi=picture.dpi,
                    bbox=picture.bbox,
                    page_size=picture.page_size,
                    caption=picture.caption,
                    ref=picture.ref,
                )
                urls.append(f"/v1/documents/{self.document_id}/pictures/{number}")
            Path(picture.path).unlink(missing_ok=True)
        if descriptions:
            markdown = insert_descriptions(markdown, descriptions)
        page: dict[str, Any] = {
            "page": event.page,
            "markdown": markdown,
            "pictures": event.picture_count,
            "tables": event.tables,
            "ms": event.ms,
        }
        if self.spec.output_format == "json":
            page["json"] = event.json
        if self.document_id is not None:
            page["picture_urls"] = urls
        self.pages.append(page)
        await self.reporter.send(PageReady(page=page))
        now = time.monotonic()
        if now - self.progress_saved_at >= PROGRESS_SAVE_SECS:
            self.progress_saved_at = now
            await DocumentJob.objects.filter(pk=self.job.pk).aupdate(pages_done=len(self.pages))

    async def _describe(self, png: bytes) -> str:
        """The vision model's description of one picture."""
        work = GenerateWork(
            messages=[{"role": "user", "content": f"{IMAGE_MARKER}\n{DESCRIBE_PROMPT}"}],
            max_tokens=DESCRIBE_MAX_TOKENS,
            temperature=0.0,
            images=[png],
        )
        assert self.spec.describe_pictures is not None
        request = EngineRequest(request_id=new_request_id(), model=self.spec.describe_pictures, work=work)
        call, _started = await self.client.start(request)
        drained = await call.drain()
        self.described += 1
        return " ".join(drained.text.split())

    def _document(self, opened: DocumentOpened, done: Done, total_ms: float) -> dict[str, Any]:
        telemetry = {**done.telemetry, "inference_latency_ms": round(total_ms, 1)}
        engine = dict(telemetry.get("engine") or {})
        if self.described:
            engine["pictures_described"] = self.described
        telemetry["engine"] = engine
        document: dict[str, Any] = {"object": "document"}
        if self.document_id is not None:
            document["id"] = self.document_id
            document["pictures_expire_at"] = self.expires_at
        document.update(
            {
                "model": self.spec.model,
                "filename": self.spec.filename,
                "page_count": opened.page_count,
                "pages": [],
                "markdown": join_pages([p["markdown"] for p in self.pages]),
                "usage": {
                    "pages": len(self.pages),
                    "pictures": self.picture_count,
                    "tables": sum(p["tables"] for p in self.pages),
                    "pictures_described": self.described,
                },
                "hypnos_telemetry": telemetry,
            }
        )
        return document


def _pages_done(conversion: _Conversion | None) -> int:
    return len(conversion.pages) if conversion is not None else 0


def insert_descriptions(markdown: str, descriptions: list[str]) -> str:
    """Each description under its picture's placeholder, in order, as `> **Picture:** …`."""
    remaining = iter(descriptions)

    def described(match: re.Match[str]) -> str:
        text = next(remaining, None)
        return match.group(0) if text is None else f"{PLACEHOLDER}\n\n> **Picture:** {text}"

    return re.sub(re.escape(PLACEHOLDER), described, markdown)


def _picture_dir(job_id: str) -> Path:
    return settings.HYPNOS.data_dir / "spool" / f"{job_id}-pictures"


async def _set(job: DocumentJob, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(job, name, value)
    await DocumentJob.objects.filter(pk=job.pk).aupdate(**fields)


async def _discard(job: DocumentJob) -> None:
    """A failed or cancelled job keeps no pictures."""
    refreshed = await DocumentJob.objects.aget(pk=job.pk)
    if refreshed.document_id:
        await sync_to_async(pictures.discard_document)(refreshed.document_id)
