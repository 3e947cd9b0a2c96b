"""The worker's document conversion (spec §12): open the upload, check the pages asked for, then
convert page by page, each page an event as soon as it is ready.

Everything that can refuse the request (an empty, corrupt, encrypted or unsupported file, pages
outside the document, more pages than limits.max_document_pages) happens before `started`, so
the client gets its HTTP status; after that a conversion only ends early when it is cancelled
(the client left: the engine stops before its next page) or the engine fails. Pictures go to
the request's picture_dir as PNG files, not inline: a page's pictures can exceed what one
channel-layer message carries. The job that asked (inference/jobs/feed.py) removes them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest
from inference.transport.wire import DocumentOpened, DocumentPage, DocumentWork, Done, PictureFile, Started

if TYPE_CHECKING:
    from inference.engines.document import DoclingEngine, PageResult
    from inference.worker.runtime import ModelRuntime
    from inference.worker.tier_moves import TierMoves


def check_document_model(config: ModelConfig) -> None:
    if config.modality != "document_conversion":
        raise InvalidRequest(
            f"The model {config.id!r} serves {config.modality}, not document_conversion (/v1/documents/convert).",
            param="model",
        )


def page_numbers(spec: str | None, page_count: int) -> list[int]:
    """The 1-based pages of `pages` ("3", "2-5"; None: all), 400 when outside the document."""
    if spec is None:
        return list(range(1, page_count + 1))
    first, dash, last = spec.strip().partition("-")
    try:
        start = int(first)
        end = int(last) if dash else start
    except ValueError:
        raise InvalidRequest(
            f"pages must be a page number or a range like '2-5', not {spec!r}.", param="pages"
        ) from None
    if start < 1 or end < start:
        raise InvalidRequest(f"pages {spec!r} is not a range of pages counted from 1.", param="pages")
    if end > page_count:
        raise InvalidRequest(
            f"pages {spec!r} is outside the document, which has {page_count} page{'s' * (page_count != 1)}.",
            param="pages",
        )
    return list(range(start, end + 1))


def serve_document(
    moves: TierMoves,
    runtime: ModelRuntime,
    engine: DoclingEngine,
    work: DocumentWork,
    cancel: threading.Event,
    sink: Any,
    queue_ms: float,
) -> Done:
    switch = moves.ensure_tier1(runtime, runtime.config.context_len)
    placement = moves.tiers.placement(runtime.config.id)
    document = engine.open_document(Path(work.path), work.filename, work.max_pages)
    try:
        pages = page_numbers(work.pages, document.page_count)
        sink(
            Started(
                previous_tier=str(switch.previous_tier),
                gpu_layers=placement.gpu_layers,
                tier_switch_ms=switch.switch_ms,
            )
        )
        sink(
            DocumentOpened(
                page_count=document.page_count, pages=pages, format=document.format, pipeline=document.pipeline
            )
        )
        started = time.perf_counter()
        converted = engine.convert_pages(
            document,
            pages,
            ocr=work.ocr,
            want_json=work.want_json,
            want_pictures=work.picture_dir is not None,
            cancel=cancel,
        )
        for result in converted:
            sink(_page_event(result, work.picture_dir))
        inference_ms = (time.perf_counter() - started) * 1000
    finally:
        engine.close_document(document)
    engine_timings = {
        "queue_ms": round(queue_ms, 1),
        "pages": len(pages),
        "ms_per_page": round(inference_ms / len(pages), 1) if pages else 0.0,
        "pipeline": document.pipeline,
        "format": document.format,
    }
    telemetry = switch.telemetry(placement, inference_ms, engine_timings)
    return Done(result={"page_count": document.page_count, "pages": len(pages)}, telemetry=telemetry)


def _page_event(result: PageResult, picture_dir: str | None) -> DocumentPage:
    """The page's event, its pictures written to picture_dir (named by page and position)."""
    pictures = []
    for position, picture in enumerate(result.pictures, start=1):
        assert picture_dir is not None  # the engine returns pictures only when they are wanted
        path = Path(picture_dir) / f"page{result.page}-{position}.png"
        path.write_bytes(picture.png)
        pictures.append(
            PictureFile(
                path=str(path),
                width=picture.width,
                height=picture.height,
                dpi=picture.dpi,
                bbox=picture.bbox,
                page_size=picture.page_size,
                caption=picture.caption,
                ref=picture.ref,
            )
        )
    return DocumentPage(
        page=result.page,
        markdown=result.markdown,
        tables=result.tables,
        ms=round(result.ms, 1),
        ocr=result.ocr,
        json=result.json,
        picture_count=result.picture_count,
        pictures=pictures,
    )
