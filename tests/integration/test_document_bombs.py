"""Documents that cost the worker far more than their size (issue 35): a huge blank page, zip
parts that inflate past what the directory declares or into more items than docling can hold,
and pictures above limits.max_image_pixels. Each goes through the real route, Celery (eager)
and the real docling engine; the worker runs in this process, so its memory is this process's
RSS, sampled while the request runs. The documents are built at run time (tests/bomb_documents.py,
shared with bench/bombs.py), a few KB to a few MB each, without ever holding the pixels or the
inflated bytes they declare."""

from __future__ import annotations

import io
import threading
import zlib
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.test import AsyncClient
from docx import Document
from docx.shared import Inches

from inference.engines import document as engine_module
from inference.engines.document import MAX_HTML_DEPTH
from tests.bomb_documents import docx_with_body, lying_docx, pdf_bytes, white_png
from tests.integration.conftest import with_limits

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/documents/convert"
# What the findings cost before the fix: 6 GB and more (the page), +1.7 GB (the lying part),
# +1 GB (the honest DOCX), +686 MB (the PNG). The smaller documents here took 911 MiB (the
# page), 522 MiB (the lying part), 521 MiB (the PNG) and 450 MiB (the PDF picture); the honest
# DOCXs (198 MiB and 45 s for the paragraphs) and the DOCX picture (144 MiB) were converted.
MAX_GROWTH_BYTES = 150 << 20
# A page read by OCR: the detector's ~150 bytes a pixel of ocr.DETECTION_PIXELS (~143 MiB), the
# render and its copy (23 MiB), the rest of the conversion: 125-150 MiB measured.
MAX_OCR_GROWTH_BYTES = 256 << 20
BIG_SIDE = 5000  # 25 Mpx, above the default limits.max_image_pixels (4096 x 4096)


class PeakRss:
    """The most this process's RSS grew above its start while the block ran, sampled every 5 ms
    on a thread (the worker's conversion runs on threads of this process)."""

    def __enter__(self) -> PeakRss:
        self._process = psutil.Process()
        self._before = self._peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self._peak = max(self._peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self._peak - self._before


async def converted(request: Awaitable[Any]) -> tuple[Any, int]:
    """The response and how much the process grew while it was made."""
    with PeakRss() as rss:
        response = await request
    return response, rss.growth


async def upload(api: AsyncClient, path: Path, **fields: Any) -> Any:
    with open(path, "rb") as file:
        return await api.post(URL, data={"model": "docling", "file": file, **fields})


def assert_refused(response: Any, message: str) -> None:
    """The spec's 400 envelope naming `file`, exactly."""
    assert response.status_code == 400, response.content[:500]
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": "file", "code": "invalid_request_error"}
    }


def assert_small(growth: int) -> None:
    assert growth < MAX_GROWTH_BYTES, f"the process grew {growth >> 20} MiB, above {MAX_GROWTH_BYTES >> 20} MiB"


# Documents: tests/bomb_documents.py's builders (bench/bombs.py sends the same ones).


def blank_page_pdf(path: Path, side_pt: int) -> Path:
    """The finding's document: one blank square page, no text layer (so OCR renders it)."""
    path.write_bytes(pdf_bytes((side_pt, side_pt)))
    return path


def grey_image_pdf(path: Path, side_px: int) -> Path:
    """A Letter page showing one side_px x side_px grey image (Flate, ~100 KB)."""
    deflate = zlib.compressobj(9)
    row = b"\x80" * side_px
    data = b"".join(deflate.compress(row) for _ in range(side_px)) + deflate.flush()
    image = (
        b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray "
        b"/BitsPerComponent 8 /Filter /FlateDecode /Length %d >>\nstream\n"
        % (side_px, side_px, len(data))
        + data
        + b"\nendstream"
    )
    path.write_bytes(pdf_bytes((612, 792), b"q 400 0 0 400 100 200 cm /Im1 Do Q", image))
    return path


# 1. A page rendered for OCR at most at limits.max_page_pixels.


async def test_a_huge_blank_page_is_rendered_for_ocr_within_max_page_pixels(api, tmp_path, settings):
    # 3000 pt square at 180 dpi is 7500 x 7500 pixels (+1 GB before the fix); within 500,000
    # pixels it is rendered at 707 x 707. The OCR's own workspace grows with the pixels it reads
    # (~130 bytes a pixel, up to the 2000 x 2000 rapidocr shrinks a page to), so a first page of
    # that size (283 pt) sizes it, and the growth measured is the huge page's own.
    with_limits(settings, max_page_pixels=500_000)
    warm = await upload(api, blank_page_pdf(tmp_path / "warm.pdf", 283))
    assert warm.status_code == 200, warm.content
    response, growth = await converted(upload(api, blank_page_pdf(tmp_path / "huge.pdf", 3000)))
    assert response.status_code == 200, response.content
    assert response.json()["page_count"] == 1 and response.json()["markdown"] == ""
    assert_small(growth)


async def test_a_huge_or_thin_page_costs_an_a4_page_s_ocr_workspace_at_the_default_limits(api, tmp_path):
    # The finding itself (14,400 pt square) and two thin pages, default limits. A page is
    # rendered at most 2000 px on its longer side and the detector sees at most DETECTION_PIXELS
    # whatever the shape, so each costs at most what an A4 page's OCR does (125-150 MiB
    # measured, the worker returning large buffers as they are freed: core.return_large_buffers).
    # Before: the square +494-558 MiB (the 4096 x 4096 render, its copy, the detector on
    # 2000 x 2000 at ~150 bytes a pixel), the 200 x 14,400 pt page +4.4 GiB (rapidocr enlarged
    # its 28 px width to 736 before detecting).
    warm = await upload(api, a4_blank_pdf(tmp_path / "a4.pdf"))
    assert warm.status_code == 200, warm.content
    for name, box in (("square", (14_400, 14_400)), ("thin", (200, 14_400)), ("flat", (14_400, 20))):
        path = tmp_path / f"{name}.pdf"
        path.write_bytes(pdf_bytes(box))
        response, growth = await converted(upload(api, path))
        assert response.status_code == 200, (name, response.content)
        assert response.json()["page_count"] == 1 and response.json()["markdown"] == ""
        assert growth < MAX_OCR_GROWTH_BYTES, f"{name}: the process grew {growth >> 20} MiB"


def a4_blank_pdf(path: Path) -> Path:
    path.write_bytes(pdf_bytes((595, 842)))
    return path


# 2. Zip parts inflated against hard caps, whatever the directory declares.


async def test_a_docx_part_that_inflates_past_its_declared_size_is_refused(api, tmp_path):
    path = lying_docx(tmp_path / "liar.docx")
    assert path.stat().st_size < 1 << 20
    response, growth = await converted(upload(api, path))
    assert_refused(
        response,
        "The archive's data does not match its directory (word/document.xml inflates past the 308 bytes "
        "it declares): a damaged file or a zip bomb.",
    )
    assert_small(growth)


async def test_an_honest_docx_of_more_paragraphs_than_docling_can_hold_is_refused(api, tmp_path):
    # 60,000 empty paragraphs: 360 KB of XML in a 40 KB file, each paragraph a docling item
    # of ~4 KB (200,000 of them took 750 MB and 148 s).
    path = docx_with_body(tmp_path / "paragraphs.docx", "<w:p/>" * 60_000)
    response, growth = await converted(upload(api, path))
    assert_refused(
        response,
        "The document has more than 50000 paragraphs, the most a conversion may hold in memory.",
    )
    assert_small(growth)


async def test_an_honest_docx_of_more_elements_than_docling_can_hold_is_refused(api, tmp_path):
    # 210,000 line breaks in one run, each numbered so that the part does not compress past the
    # ratio the directory check refuses.
    breaks = "".join(f'<w:br w:id="{i}"/>' for i in range(210_000))
    path = docx_with_body(tmp_path / "elements.docx", f"<w:p><w:r>{breaks}</w:r></w:p>")
    response, growth = await converted(upload(api, path))
    assert_refused(
        response,
        "The document has more than 200000 XML elements, the most a conversion may hold in memory.",
    )
    assert_small(growth)


async def test_a_docx_of_more_markup_than_allowed_is_refused(api, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "MAX_MARKUP_BYTES", 1 << 20)
    # 1.5 MB of numbers in 1,000 paragraphs.
    body = "".join(f"<w:p><w:r><w:t>{' '.join(map(str, range(i, i + 250)))}</w:t></w:r></w:p>" for i in range(1000))
    response = await upload(api, docx_with_body(tmp_path / "markup.docx", body))
    assert_refused(response, "The document's XML inflates past 1 MiB, the most a conversion may hold in memory.")


# 3. Every picture inside a document checked against limits.max_image_pixels before a decode.


async def test_a_docx_picture_above_max_image_pixels_is_refused_from_its_header(api, tmp_path):
    document = Document()
    document.add_paragraph("A picture too large to decode.")
    document.add_picture(io.BytesIO(white_png(BIG_SIDE, BIG_SIDE)), width=Inches(2))
    path = tmp_path / "picture.docx"
    document.save(str(path))
    response, growth = await converted(upload(api, path))
    assert_refused(
        response,
        f"The archive member word/media/image1.png is {BIG_SIDE}x{BIG_SIDE} pixels, above "
        "limits.max_image_pixels (16777216).",
    )
    assert_small(growth)


async def test_an_image_document_above_max_image_pixels_is_refused_from_its_header(api, tmp_path):
    path = tmp_path / "scan.png"
    path.write_bytes(white_png(BIG_SIDE, BIG_SIDE))
    response, growth = await converted(upload(api, path))
    assert_refused(response, f"The image is {BIG_SIDE}x{BIG_SIDE} pixels, above limits.max_image_pixels (16777216).")
    assert_small(growth)


async def test_a_pdf_picture_above_max_image_pixels_is_refused_when_pictures_are_kept(api, tmp_path):
    # docling-parse decodes the bitmaps only for pictures (return_pictures, describe_pictures).
    path = grey_image_pdf(tmp_path / "poster.pdf", 6000)
    response, growth = await converted(upload(api, path, return_pictures="true"))
    assert_refused(response, "An image on page 1 is 6000x6000 pixels, above limits.max_image_pixels (16777216).")
    assert_small(growth)
    # Without pictures nothing decodes it: the page converts.
    plain = await upload(api, path)
    assert plain.status_code == 200, plain.content


# 4. An HTML tree nested past what docling's recursive walk reads.


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("nested", "<div>" * 5000 + "x" + "</div>" * 5000),  # 27.7 s to fail before
        ("unclosed", "<p>a paragraph" * 5000),  # BeautifulSoup nests each unclosed <p> in the last
    ],
)
async def test_an_html_document_nested_past_the_depth_limit_is_refused_before_docling(api, tmp_path, name, body):
    path = tmp_path / f"{name}.html"
    path.write_text(f"<!doctype html><html><body>{body}</body></html>")
    response, growth = await converted(upload(api, path))
    assert_refused(
        response,
        f"The HTML document nests its elements more than {MAX_HTML_DEPTH} deep (unclosed or nested tags); "
        "the converter cannot read it.",
    )
    assert_small(growth)


async def test_an_html_document_of_many_closed_paragraphs_and_void_elements_is_converted(api, tmp_path):
    rows = "".join(f"<p>Paragraph {i}<br><img src='x.png' alt=''></p>" for i in range(400))
    path = tmp_path / "flat.html"
    path.write_text(f"<!doctype html><html><body><div><div>{rows}</div></div></body></html>")
    response = await upload(api, path)
    assert response.status_code == 200, response.content[:500]
    assert "Paragraph 399" in response.json()["markdown"]
