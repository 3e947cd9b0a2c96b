"""Document conversion with docling, page by page, without torch (research/models.md §9b).

docling's DocumentConverter imports torch (its ASR pipeline does at import time), so the engine
drives docling's backends and pipelines itself:

- PDF: docling-parse's threaded backend, opened once per conversion over the requested range,
  its pages taken as the parser finishes them; each page's text lines and embedded bitmaps are
  laid out into that page's DoclingDocument (inference/engines/page_layout.py), as docling's
  model-free NativePdfPipeline would read them but in reading order. Pages without a text layer
  are rendered with pdfium and read by OCR (inference/engines/ocr.py).
- DOCX, PPTX, XLSX, HTML, Markdown, CSV: docling's declarative backends through its
  SimplePipeline; one page.
- Images: OCR of the image; the image itself is the page's picture when no text is read.

Hostile input is refused in `open_document` before any parser sees more than the header: the
bytes say the format, zips are checked by their directory and then inflated here against hard
caps, PDFs are opened by pdfium, images (also those inside zips) checked against
limits.max_image_pixels from their headers. What docling cannot be kept from holding is bounded
too: a page is rendered for OCR at most at limits.max_page_pixels, and a PDF's bitmaps, which
docling-parse decodes whole for pictures, are checked by pdfium first."""

from __future__ import annotations

import io
import math
import re
import struct
import threading
import time
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, BinaryIO

from docling_core.types.doc import DoclingDocument, PictureItem
from PIL import Image

from hypnos_site.config import LimitsConfig, ModelConfig
from hypnos_site.errors import Cancelled, HypnosError, InvalidRequest, ModelNotAvailable
from inference.engines.base import Engine, LoadPhases, WarmCopy, drop_page_cache
from inference.engines.ocr import MODEL_FILES, PageReader
from inference.engines.page_layout import Box, Figure, Line, page_document
from memory.planner import Footprint, footprint_from_files

# Measured converting the multi-page test PDF with a scanned page (2-core CPU): the process
# grows ~190 MB beyond the ONNX files (docling-parse's page decode, the 2.5x page render and the
# PP-OCR detector's activations on it).
WORKSPACE_BYTES = 224 << 20
# Pages without a text layer are rendered at this many pixels per PDF point (180 dpi) for OCR:
# 12 pt print comes out ~30 px tall, where PP-OCRv4 reads best. A larger page is rendered at
# less, within limits.max_page_pixels (ocr_scale).
OCR_SCALE = 2.5
# ... and at most this many pixels on the longer side: an A4 page comes out 1414 x 2000, the size
# rapidocr itself reduced a page to before reading it; more would cost memory and read no better.
READ_MAX_SIDE = 2000
# A zip (DOCX/PPTX/XLSX) may inflate to at most this much in all: its directory's sizes are
# checked against it before anything is inflated, then each member is inflated and counted
# (check_zip). python-docx and python-pptx hold every part in memory; a real document's media
# hardly compress, so they inflate to about the upload (limits.max_document_bytes, 100 MiB).
MAX_UNZIPPED_BYTES = 256 << 20
# A member over 1 MiB may inflate at most this ratio (XML compresses ~10-30x).
MAX_ZIP_RATIO = 200
# What the XML parts may hold, counted as they are inflated. docling 2.143 makes each paragraph
# an item of ~4 KB, empty or not (RSS, measured: a 38 KB DOCX of 200,000 empty paragraphs took
# 750 MB and 148 s), ~1.3 KB of every other element (an XLSX cell), ~5.5x the bytes of text.
# Together at most ~400 MB; a Word document of some 300 pages or a sheet of ~75,000 cells fits.
MAX_PARAGRAPHS = 50_000
MAX_MARKUP_ELEMENTS = 200_000
MAX_MARKUP_BYTES = 64 << 20
# An HTML document whose tree nests deeper than this is refused before docling reads it: docling
# walks BeautifulSoup's tree by recursion, and 5,000 nested divs took it 27.7 s to fail. The
# depth is the tree's as BeautifulSoup's html.parser builds it, where an unclosed <p>, <li> or
# <span> holds everything after it.
MAX_HTML_DEPTH = 256
# The elements that hold nothing (BeautifulSoup's HTML builder closes them at once).
VOID_ELEMENTS = frozenset(
    "area base basefont bgsound br col command embed frame hr image img input isindex keygen link "
    "menuitem meta nextid param source spacer track wbr".split()
)
# A member's data is inflated in pieces of at most this many bytes (check_zip).
ZIP_CHECK_CHUNK = 1 << 16
# A start tag, and a paragraph's: w:p, a:p, the local name p under any prefix (of at most 64 bytes).
START_TAG = re.compile(rb"<[^/?!]")
PARAGRAPH_TAG = re.compile(rb"<(?:[^\s<>/?!:]{1,64}:)?p[\s/>]")
ZIP_FORMATS = {"word/document.xml": "docx", "ppt/presentation.xml": "pptx", "xl/workbook.xml": "xlsx"}
TEXT_EXTENSIONS = {".md": "md", ".markdown": "md", ".txt": "md", ".csv": "csv", ".html": "html", ".htm": "html"}
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"II*\x00", b"MM\x00*", b"BM", b"GIF8")


@dataclass
class PictureImage:
    png: bytes
    width: int
    height: int
    dpi: int | None
    bbox: dict[str, Any] | None
    page_size: dict[str, float] | None
    caption: str | None
    ref: str | None


@dataclass
class PageResult:
    page: int
    markdown: str
    json: dict[str, Any] | None
    tables: int
    pictures: list[PictureImage]
    ms: float
    ocr: bool
    # The page's pictures (its placeholders), also when their images were not asked for.
    picture_count: int = 0


@dataclass
class OpenedDocument:
    format: str
    page_count: int
    pipeline: str
    path: Path
    name: str
    # The PDF open in pdfium (renders pages for OCR), or the image input.
    pdfium: Any = None
    image: Image.Image | None = None
    # A declarative format's docling input, its backend already open.
    input: Any = None
    closers: list[Any] = field(default_factory=list)


class DoclingEngine(Engine):
    """docling's backends plus PP-OCRv4 on onnxruntime; the ONNX files are its weights."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        super().__init__(model, weights, n_threads, aux)
        self._copies: dict[str, WarmCopy] = {}
        self._reader: PageReader | None = None
        self._simple: Any = None

    @property
    def files(self) -> list[Path]:
        missing = [name for name in MODEL_FILES if not (self.weights / name).is_file()]
        if missing:
            raise ModelNotAvailable(f"model {self.model.id!r}: {self.weights} lacks the OCR models {missing}")
        return [self.weights / name for name in MODEL_FILES]

    @property
    def loaded(self) -> bool:
        return self._reader is not None

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    @property
    def warm_bytes(self) -> int:
        return sum(copy.size for copy in self._copies.values())

    def warm(self) -> float:
        if self._copies:
            return 0.0
        started = time.perf_counter()
        for path in self.files:
            self._copies[path.name] = WarmCopy(path)
        return (time.perf_counter() - started) * 1000

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._copies else "read"
        weights_ms = self.warm()
        from docling.datamodel.pipeline_options import ConvertPipelineOptions
        from docling.pipeline.simple_pipeline import SimplePipeline

        try:
            self._reader = PageReader({name: copy.path for name, copy in self._copies.items()}, self.n_threads)
        except Exception as exc:  # onnxruntime raises its own types for a bad graph
            raise ModelNotAvailable(f"model {self.model.id!r}: the OCR models could not be loaded: {exc}") from exc
        self._simple = SimplePipeline(ConvertPipelineOptions())
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms, context_ms=total_ms - weights_ms, total_ms=total_ms)

    def unload(self) -> None:
        self._reader = None
        self._simple = None

    def cool(self) -> None:
        self.unload()
        for copy in self._copies.values():
            copy.close()
        self._copies = {}
        for path in self.files:
            drop_page_cache(path)

    # The conversion API the worker's document op calls.

    def open_document(self, path: Path, filename: str | None, max_pages: int) -> OpenedDocument:
        """Read the document far enough to know its format and page count; refuse what cannot
        or must not be converted (InvalidRequest naming `file`)."""
        fmt = sniff_format(path, filename)
        name = Path(filename or path.name).stem or "document"
        if fmt == "pdf":
            doc = _open_pdf(path, name)
        elif fmt == "image":
            doc = _open_image(path, name, _limits().max_image_pixels)
        else:
            if fmt in ZIP_FORMATS.values():
                check_zip(path, _limits().max_image_pixels)
            elif fmt == "html":
                check_html(path)
            doc = _open_declarative(path, name, fmt)
        if doc.page_count > max_pages:
            self.close_document(doc)
            raise InvalidRequest(
                f"The document has {doc.page_count} pages, more than the limit of {max_pages}.", param="file"
            )
        return doc

    def convert_pages(
        self,
        doc: OpenedDocument,
        pages: list[int],
        *,
        ocr: bool,
        want_json: bool,
        want_pictures: bool,
        cancel: threading.Event,
    ) -> Iterator[PageResult]:
        """Each requested page as soon as it is converted, in the order asked for."""
        assert self._reader is not None and self._simple is not None, "convert_pages on an unloaded engine"
        if doc.format == "pdf":
            converted = self._pdf_pages(doc, pages, ocr, want_pictures, cancel)
        elif doc.format == "image":
            converted = self._image_page(doc, ocr, want_pictures, cancel)
        else:
            converted = self._declarative_page(doc, cancel)
        try:
            for page_no, document, read, ms in converted:
                yield _page_result(page_no, document, read, ms, want_json, want_pictures)
        except (HypnosError, GeneratorExit):
            raise
        except Exception as exc:  # docling, pdfium and PIL raise their own types on bad pages
            raise InvalidRequest(f"The document could not be converted: {exc}", param="file") from exc

    def close_document(self, doc: OpenedDocument) -> None:
        """Release the parsers and files the opened document holds."""
        for close in doc.closers:
            close()
        doc.closers.clear()

    # One generator per kind of input: (page number, page document, read by OCR, ms).

    def _pdf_pages(
        self, doc: OpenedDocument, pages: list[int], ocr: bool, want_pictures: bool, cancel: threading.Event
    ) -> Iterator[tuple[int, DoclingDocument, bool, float]]:
        from docling_core.types.doc.page import TextCellUnit

        if want_pictures:
            _check_pdf_images(doc, pages, _limits().max_image_pixels)
        backend = _pdf_backend(doc, min(pages), max(pages), want_pictures, self.n_threads)
        parsed = _in_page_order(backend.iter_pages(), pages)
        try:
            for page_no in pages:
                if cancel.is_set():
                    raise Cancelled("the conversion was cancelled")
                started = time.perf_counter()
                page_backend = next(parsed)
                size = page_backend.get_size()
                segmented = page_backend.get_segmented_page()
                lines = [_pdf_line(cell, size.height) for cell in segmented.iterate_cells(TextCellUnit.LINE)]
                lines = [line for line in lines if line.text]
                figures = [_pdf_figure(bitmap, size.height) for bitmap in segmented.bitmap_resources]
                page_backend.unload()
                read = False
                if not lines and ocr:
                    lines = self._ocr_pdf_page(doc, page_no)
                    read = True
                    # The scan the text was read from is the page itself, not a picture on it.
                    figures = [f for f in figures if not any(_inside(line.box, f.box) for line in lines)]
                document = page_document(doc.name, page_no, size.width, size.height, lines, figures)
                yield page_no, document, read, (time.perf_counter() - started) * 1000
        finally:
            backend.unload()

    def _ocr_pdf_page(self, doc: OpenedDocument, page_no: int) -> list[Line]:
        assert self._reader is not None
        page = doc.pdfium[page_no - 1]
        scale = ocr_scale(page.get_width(), page.get_height(), _limits().max_page_pixels)
        # pdfium renders BGR, the order PP-OCR takes: read in place, not copied through PIL.
        bitmap = page.render(scale=scale)
        return self._reader.read_pixels(bitmap.to_numpy(), scale)

    def _image_page(
        self, doc: OpenedDocument, ocr: bool, want_pictures: bool, cancel: threading.Event
    ) -> Iterator[tuple[int, DoclingDocument, bool, float]]:
        assert self._reader is not None and doc.image is not None
        if cancel.is_set():
            raise Cancelled("the conversion was cancelled")
        started = time.perf_counter()
        image = doc.image
        lines = self._reader.read(image, 1.0) if ocr else []
        dpi = _image_dpi(image)
        figures = [] if lines else [Figure(image.convert("RGB"), Box(0, 0, image.width, image.height), dpi)]
        document = page_document(doc.name, 1, image.width, image.height, lines, figures)
        yield 1, document, ocr, (time.perf_counter() - started) * 1000

    def _declarative_page(
        self, doc: OpenedDocument, cancel: threading.Event
    ) -> Iterator[tuple[int, DoclingDocument, bool, float]]:
        from docling.datamodel.base_models import ConversionStatus

        if cancel.is_set():
            raise Cancelled("the conversion was cancelled")
        started = time.perf_counter()
        result = self._simple.execute(doc.input, raises_on_error=False)
        doc.closers.clear()  # execute() has closed the backend
        if result.status not in (ConversionStatus.SUCCESS, ConversionStatus.PARTIAL_SUCCESS):
            reasons = "; ".join(e.error_message for e in result.errors) or result.status.value
            raise InvalidRequest(f"The document could not be converted: {reasons}", param="file")
        yield 1, result.document, False, (time.perf_counter() - started) * 1000


def sniff_format(path: Path, filename: str | None) -> str:
    """The document's format from its first bytes, the filename's extension second (text)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        raise InvalidRequest("The file is empty.", param="file")
    if b"%PDF-" in head[:1024]:
        return "pdf"
    if head.startswith(IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return "image"
    if head.startswith(b"PK\x03\x04"):
        return _zip_format(path)
    return _text_format(head, filename)


def _zip_format(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InvalidRequest(f"The file is a damaged zip archive: {exc}", param="file") from exc
    for member, fmt in ZIP_FORMATS.items():
        if member in names:
            return fmt
    raise InvalidRequest("Unsupported format: a zip archive that is not DOCX, PPTX or XLSX.", param="file")


def _text_format(head: bytes, filename: str | None) -> str:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the end of the sample is still text.
        if exc.start < len(head) - 4:
            raise InvalidRequest(
                "Unsupported format: the file is neither a PDF, an image, an office document nor text.",
                param="file",
            ) from exc
        text = head[: exc.start].decode("utf-8")
    start = text.lstrip("\ufeff \t\r\n")[:512].lower()
    if start.startswith(("<!doctype html", "<html")) or "<body" in start:
        return "html"
    extension = Path(filename or "").suffix.lower()
    return TEXT_EXTENSIONS.get(extension, "md")


class _Depth(HTMLParser):
    """The nesting of an HTML document's tree as BeautifulSoup's html.parser builder makes it
    (an end tag closes back to its open tag; an unmatched one is ignored), without the tree;
    stops at the first element past MAX_HTML_DEPTH."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID_ELEMENTS:
            return
        self.open.append(tag)
        if len(self.open) > MAX_HTML_DEPTH:
            raise InvalidRequest(
                f"The HTML document nests its elements more than {MAX_HTML_DEPTH} deep (unclosed or nested "
                "tags); the converter cannot read it.",
                param="file",
            )

    def handle_endtag(self, tag: str) -> None:
        if tag in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag) :]


def check_html(path: Path) -> None:
    """Refuse an HTML document nested past MAX_HTML_DEPTH (InvalidRequest naming `file`)."""
    parser = _Depth()
    parser.feed(path.read_bytes().decode("utf-8", errors="replace"))
    parser.close()


def check_zip(path: Path, max_image_pixels: int) -> None:
    """Refuse a zip bomb before docling opens the archive (InvalidRequest naming `file`).

    The directory's declared sizes are checked first, before anything is inflated. Then every
    member is inflated here, ZIP_CHECK_CHUNK bytes at a time and counted, never trusting the
    directory: zipfile stops a member at its declared size but inflates all of its data first
    (+1.7 GB for a 1.5 MB DOCX whose 1.5 GiB part declares 308 bytes and their CRC). A member
    that inflates past its declared size is refused at once, so the total inflated stays within
    the declared total, itself within MAX_UNZIPPED_BYTES. The XML parts are counted against what
    docling can hold (MAX_PARAGRAPHS, MAX_MARKUP_*), every other member's image header against
    `max_image_pixels` (docling decodes every picture whole)."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            members = archive.infolist()
            _check_declared_sizes(members)
            markup = _MarkupCount()
            binaries = [member for member in members if not _check_member_data(raw, member, markup)]
            # The data now holds to the directory, so zipfile reads each member as declared.
            for member in binaries:
                with archive.open(member) as data:
                    _check_pixels(data, max_image_pixels, f"The archive member {member.filename}")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as exc:
        raise _mismatch(str(exc)) from exc


def _check_declared_sizes(members: list[zipfile.ZipInfo]) -> None:
    for member in members:
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > 1 << 20 and ratio > MAX_ZIP_RATIO:
            raise InvalidRequest(
                f"The archive member {member.filename} inflates {ratio:.0f}x (a zip bomb); "
                f"at most {MAX_ZIP_RATIO}x is allowed.",
                param="file",
            )
    total = sum(m.file_size for m in members)
    if total > MAX_UNZIPPED_BYTES:
        raise InvalidRequest(
            f"The archive inflates to {total >> 20} MiB, more than the {MAX_UNZIPPED_BYTES >> 20} MiB allowed.",
            param="file",
        )


def _check_member_data(raw: BinaryIO, member: zipfile.ZipInfo, markup: _MarkupCount) -> bool:
    """Inflate one member against its declared size and CRC; True when it is XML (counted)."""
    if member.flag_bits & 1:
        raise InvalidRequest(f"The archive member {member.filename} is encrypted.", param="file")
    size = crc = 0
    markup.begin()
    for piece in _inflated(raw, member):
        size += len(piece)
        if size > member.file_size:
            raise _mismatch(f"{member.filename} inflates past the {member.file_size} bytes it declares")
        crc = zlib.crc32(piece, crc)
        markup.feed(piece)
    if size != member.file_size:
        raise _mismatch(f"{member.filename} inflates to {size} bytes, not the {member.file_size} it declares")
    if crc != member.CRC:
        raise _mismatch(f"{member.filename} fails its CRC")
    return markup.end()


def _inflated(raw: BinaryIO, member: zipfile.ZipInfo) -> Iterator[bytes]:
    """The member's data as zipfile inflates it (all of its compressed bytes, whatever size the
    directory declares), in pieces of at most ZIP_CHECK_CHUNK bytes."""
    raw.seek(member.header_offset)
    header = raw.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"{member.filename} has no local header")
    name_length, extra_length = struct.unpack_from("<HH", header, 26)
    raw.seek(member.header_offset + 30 + name_length + extra_length)
    left = member.compress_size
    if member.compress_type == zipfile.ZIP_STORED:
        while left > 0 and (piece := raw.read(min(left, ZIP_CHECK_CHUNK))):
            left -= len(piece)
            yield piece
        return
    if member.compress_type != zipfile.ZIP_DEFLATED:
        raise InvalidRequest(
            f"The archive member {member.filename} uses compression method {member.compress_type}; "
            "office documents are deflated or stored.",
            param="file",
        )
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    while not inflater.eof:
        data = inflater.unconsumed_tail
        if not data and left > 0:
            data = raw.read(min(left, ZIP_CHECK_CHUNK))
            left -= len(data)
        piece = inflater.decompress(data, ZIP_CHECK_CHUNK)
        if piece:
            yield piece
        elif not data:
            return  # the data ends before the deflate stream does


def _mismatch(detail: str) -> InvalidRequest:
    return InvalidRequest(
        f"The archive's data does not match its directory ({detail}): a damaged file or a zip bomb.", param="file"
    )


class _MarkupCount:
    """What an archive's XML parts hold, counted as they are inflated, against the caps: bytes,
    elements (start tags) and paragraphs. A part is XML when its first byte past whitespace,
    byte order marks and NULs is '<' (lxml reads nothing else); a UTF-16 or UTF-32 part is
    counted with its NUL bytes removed."""

    def __init__(self) -> None:
        self.bytes = self.elements = self.paragraphs = 0
        self.begin()

    def begin(self) -> None:
        """Start on the next part."""
        self._xml: bool | None = None
        self._wide = False
        self._carry = b""

    def feed(self, piece: bytes) -> None:
        if self._xml is None:
            start = piece.lstrip(b"\x00\xef\xbb\xbf\xfe\xff \t\r\n")
            if not start:
                return
            self._xml = start.startswith(b"<")
            self._wide = b"\x00" in piece[:4] or piece.startswith((b"\xff\xfe", b"\xfe\xff"))
        if not self._xml:
            return
        self.bytes += len(piece)
        data = self._carry + (piece.replace(b"\x00", b"") if self._wide else piece)
        cut = data.rfind(b"<")
        if cut < 0:
            self._carry = b""
        else:
            # The last tag may go on in the next piece; its name is in its first 80 bytes.
            self._count(data[:cut])
            self._carry = data[cut : cut + 80]
        self._check()

    def end(self) -> bool:
        """Count what the part's last piece left; True when the part was XML."""
        self._count(self._carry)
        self._check()
        return bool(self._xml)

    def _count(self, data: bytes) -> None:
        self.elements += len(START_TAG.findall(data))
        self.paragraphs += len(PARAGRAPH_TAG.findall(data))

    def _check(self) -> None:
        held = "the most a conversion may hold in memory."
        if self.paragraphs > MAX_PARAGRAPHS:
            raise InvalidRequest(f"The document has more than {MAX_PARAGRAPHS} paragraphs, {held}", param="file")
        if self.elements > MAX_MARKUP_ELEMENTS:
            raise InvalidRequest(f"The document has more than {MAX_MARKUP_ELEMENTS} XML elements, {held}", param="file")
        if self.bytes > MAX_MARKUP_BYTES:
            raise InvalidRequest(f"The document's XML inflates past {MAX_MARKUP_BYTES >> 20} MiB, {held}", param="file")


def _check_pixels(source: Any, max_pixels: int, what: str) -> None:
    """Refuse an image that declares more than `max_pixels`, from its header (Image.open decodes
    nothing; docling and the OCR decode it whole). What Pillow does not take for an image passes:
    nothing decodes it as one either."""
    try:
        with warnings.catch_warnings():
            # Pillow warns between Image.MAX_IMAGE_PIXELS and twice that; the check below refuses it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as image:
                width, height = image.size
    except Image.DecompressionBombError:
        # Pillow's own cap (twice Image.MAX_IMAGE_PIXELS, set from the limit) refused it in open().
        raise InvalidRequest(
            f"{what} declares more pixels than limits.max_image_pixels allows ({max_pixels}).", param="file"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError):
        return
    if width * height > max_pixels:
        raise _too_many_pixels(what, width, height, max_pixels)


def _too_many_pixels(what: str, width: int, height: int, max_pixels: int) -> InvalidRequest:
    return InvalidRequest(
        f"{what} is {width}x{height} pixels, above limits.max_image_pixels ({max_pixels}).", param="file"
    )


def _check_pdf_images(doc: OpenedDocument, pages: list[int], max_pixels: int) -> None:
    """Refuse an image of the pages above `max_pixels` from its dictionary (pdfium reads the
    size without decoding; images inside forms too): docling-parse decodes every bitmap of the
    pages it reads whole when pictures are wanted (a 98 KB PDF of one 10000 x 10000 grey image
    took it 1.5 GB)."""
    import pypdfium2

    for page_no in pages:
        page = doc.pdfium[page_no - 1]
        try:
            for image in page.get_objects(filter=[pypdfium2.raw.FPDF_PAGEOBJ_IMAGE]):
                try:
                    width, height = image.get_px_size()
                except pypdfium2.PdfiumError:
                    continue  # no size pdfium can read in its dictionary: left to docling-parse
                if width * height > max_pixels:
                    raise _too_many_pixels(f"An image on page {page_no}", width, height, max_pixels)
        finally:
            page.close()


def ocr_scale(width_pt: float, height_pt: float, max_pixels: int) -> float:
    """Pixels per point to render a page at for OCR: OCR_SCALE, less for a page that would pass
    `max_pixels` (a 14,400 pt square page at OCR_SCALE is 1.3 Gpx, 4 GB of BGR) or READ_MAX_SIDE
    on its longer side."""
    return min(
        OCR_SCALE,
        math.sqrt(max_pixels / max(width_pt * height_pt, 1.0)),
        READ_MAX_SIDE / max(width_pt, height_pt, 1.0),
    )


def _limits() -> LimitsConfig:
    """This process's limits (the worker's settings.HYPNOS, which also set Image.MAX_IMAGE_PIXELS
    at start-up), read per document, never at import."""
    from django.conf import settings

    limits: LimitsConfig = settings.HYPNOS.limits
    return limits


def _open_pdf(path: Path, name: str) -> OpenedDocument:
    import pypdfium2

    with open(path, "rb") as f:
        f.seek(max(path.stat().st_size - 1024, 0))
        if b"%%EOF" not in f.read():
            raise InvalidRequest("The PDF is truncated: it has no end-of-file marker.", param="file")
    try:
        pdf = pypdfium2.PdfDocument(path)
    except pypdfium2.PdfiumError as exc:
        if exc.err_code == pypdfium2.raw.FPDF_ERR_PASSWORD:
            raise InvalidRequest("The PDF is encrypted with a password.", param="file") from exc
        raise InvalidRequest(f"The PDF is corrupt: {exc}", param="file") from exc
    if len(pdf) == 0:
        pdf.close()
        raise InvalidRequest("The PDF has no pages.", param="file")
    return OpenedDocument("pdf", len(pdf), "native_pdf", path, name, pdfium=pdf, closers=[pdf.close])


def _open_image(path: Path, name: str, max_pixels: int) -> OpenedDocument:
    _check_pixels(path, max_pixels, "The image")
    try:
        image = Image.open(path)
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"The image cannot be read: {exc}", param="file") from exc
    return OpenedDocument("image", 1, "ocr", path, name, image=image, closers=[image.close])


def _open_declarative(path: Path, name: str, fmt: str) -> OpenedDocument:
    input_format, backend = _declarative_backend(fmt)
    document = _input_document(path, input_format, backend, f"it is not a readable {fmt.upper()} file")
    return OpenedDocument(fmt, 1, "simple", path, name, input=document, closers=[document._backend.unload])


def _input_document(path: Path, input_format: Any, backend: type[Any], fallback: str, **options: Any) -> Any:
    """docling's input with its backend open, or InvalidRequest saying why the backend refused."""
    from docling.datamodel.document import InputDocument

    try:
        document = InputDocument(path_or_stream=path, format=input_format, backend=backend, **options)
    except Exception as exc:  # the format libraries (python-docx, lxml, openpyxl) raise their own types
        raise InvalidRequest(f"The document cannot be read: {exc or fallback}", param="file") from exc
    if not document.valid:
        reason = document._rejection.message if document._rejection else fallback
        raise InvalidRequest(f"The document cannot be read: {reason}", param="file")
    return document


def _declarative_backend(fmt: str) -> tuple[Any, type[Any]]:
    from docling.backend.csv_backend import CsvDocumentBackend
    from docling.backend.html_backend import HTMLDocumentBackend
    from docling.backend.md_backend import MarkdownDocumentBackend
    from docling.backend.msexcel_backend import MsExcelDocumentBackend
    from docling.backend.mspowerpoint_backend import MsPowerpointDocumentBackend
    from docling.backend.msword_backend import MsWordDocumentBackend
    from docling.datamodel.base_models import InputFormat

    return {
        "docx": (InputFormat.DOCX, MsWordDocumentBackend),
        "pptx": (InputFormat.PPTX, MsPowerpointDocumentBackend),
        "xlsx": (InputFormat.XLSX, MsExcelDocumentBackend),
        "html": (InputFormat.HTML, HTMLDocumentBackend),
        "md": (InputFormat.MD, MarkdownDocumentBackend),
        "csv": (InputFormat.CSV, CsvDocumentBackend),
    }[fmt]


def _pdf_backend(doc: OpenedDocument, first: int, last: int, want_pictures: bool, n_threads: int | None) -> Any:
    """docling-parse opened over pages first..last: one open per conversion, not per page
    (a fresh open per page costs ~75-125% on top of the conversion itself)."""
    from docling.backend.docling_parse_backend import ThreadedDoclingParseDocumentBackend
    from docling.datamodel.backend_options import ThreadedDoclingParseBackendOptions
    from docling.datamodel.base_models import InputFormat
    from docling.datamodel.settings import DocumentLimits

    options = ThreadedDoclingParseBackendOptions.model_validate(
        {
            "include_bitmap_images": want_pictures,
            "render_pages": False,
            # The parser decodes ahead on its threads while the engine lays out the page before.
            "parser_threads": max((n_threads or 2) - 1, 1),
        }
    )
    document = _input_document(
        doc.path,
        InputFormat.PDF,
        ThreadedDoclingParseDocumentBackend,
        "docling-parse cannot read it",
        backend_options=options,
        limits=DocumentLimits(page_range=(first, last)),
    )
    return document._backend


def _in_page_order(parsed: Iterator[Any], pages: list[int]) -> Iterator[Any]:
    """The parser's page backends in the order of `pages` (it finishes them out of order)."""
    wanted, early = set(pages), {}
    for page_no in pages:
        while page_no not in early:
            page_backend = next(parsed)
            if page_backend.page_no in wanted:
                early[page_backend.page_no] = page_backend
            else:
                page_backend.unload()
        yield early.pop(page_no)


def _pdf_line(cell: Any, page_height: float) -> Line:
    box = cell.rect.to_bounding_box().to_top_left_origin(page_height)
    return Line(cell.text.strip(), Box(box.l, box.t, box.r, box.b))


def _pdf_figure(bitmap: Any, page_height: float) -> Figure:
    box = bitmap.rect.to_bounding_box().to_top_left_origin(page_height)
    image = bitmap.image.pil_image if bitmap.image is not None else None
    width_pt = max(box.r - box.l, 1e-6)
    dpi = round(image.width / width_pt * 72) if image is not None else 72
    return Figure(image, Box(box.l, box.t, box.r, box.b), dpi)


def _inside(inner: Box, outer: Box) -> bool:
    x, y = (inner.l + inner.r) / 2, (inner.t + inner.b) / 2
    return outer.l <= x <= outer.r and outer.t <= y <= outer.b


def _image_dpi(image: Image.Image) -> int:
    dpi = image.info.get("dpi")
    return round(float(dpi[0])) if dpi else 72


def _page_result(
    page_no: int, document: DoclingDocument, read: bool, ms: float, want_json: bool, want_pictures: bool
) -> PageResult:
    return PageResult(
        page=page_no,
        markdown=document.export_to_markdown(),
        json=document.export_to_dict() if want_json else None,
        tables=len(document.tables),
        pictures=[_picture(document, picture) for picture in document.pictures] if want_pictures else [],
        ms=ms,
        ocr=read,
        picture_count=len(document.pictures),
    )


def _picture(document: DoclingDocument, picture: PictureItem) -> PictureImage:
    image = picture.get_image(document)
    png = io.BytesIO()
    if image is not None:
        image.save(png, format="PNG")
    prov = picture.prov[0] if picture.prov else None
    page = document.pages.get(prov.page_no) if prov else None
    return PictureImage(
        png=png.getvalue(),
        width=image.width if image is not None else 0,
        height=image.height if image is not None else 0,
        dpi=picture.image.dpi if picture.image is not None else None,
        bbox={**prov.bbox.model_dump(include={"l", "t", "r", "b"}), "coord_origin": prov.bbox.coord_origin.value}
        if prov
        else None,
        page_size={"width": page.size.width, "height": page.size.height} if page else None,
        caption=picture.caption_text(document) or None,
        ref=picture.self_ref,
    )
