"""The docling engine on real documents the tests build (tests/documents.py): real docling
backends, real PP-OCRv4 models on onnxruntime, no mocks."""

from __future__ import annotations

import io
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from PIL import Image

from hypnos_site.errors import Cancelled, InvalidRequest
from inference.engines.document import DoclingEngine, OpenedDocument, PageResult
from inference.jobs.markdown_join import join_pages
from tests import documents

SCANNED_TEXT = "Invoice number 4711\nTotal due: 120 euros"


@pytest.fixture(scope="module")
def engine() -> Iterator[DoclingEngine]:
    config = settings.HYPNOS
    model = next(m for m in config.models if m.id == "docling")
    engine = DoclingEngine(model, config.weights_file(model), 2)
    engine.load(0, 0)
    yield engine
    engine.cool()


def convert(
    engine: DoclingEngine, path: Path, pages: list[int] | None = None, **options: bool
) -> tuple[OpenedDocument, list[PageResult]]:
    doc = engine.open_document(path, path.name, max_pages=100)
    try:
        wanted = pages or list(range(1, doc.page_count + 1))
        flags = {"ocr": True, "want_json": False, "want_pictures": False, **options}
        return doc, list(engine.convert_pages(doc, wanted, cancel=threading.Event(), **flags))
    finally:
        engine.close_document(doc)


def test_it_runs_without_torch(engine: DoclingEngine) -> None:
    assert "torch" not in sys.modules


def test_it_converts_a_multipage_pdf_page_by_page(engine: DoclingEngine, tmp_path: Path) -> None:
    doc, pages = convert(engine, documents.multipage_pdf(tmp_path / "report.pdf"))
    assert (doc.format, doc.page_count, doc.pipeline) == ("pdf", 3, "native_pdf")
    assert [p.page for p in pages] == [1, 2, 3]
    assert pages[0].markdown.startswith(f"## {documents.TITLE}\n\n")
    assert "Revenue grew by twelve percent in the third quarter." in pages[0].markdown
    assert pages[0].markdown.endswith(documents.CUT_SENTENCE[0])
    assert not any(p.ocr for p in pages)


def test_it_places_the_picture_placeholder_where_the_picture_is(engine: DoclingEngine, tmp_path: Path) -> None:
    _, pages = convert(engine, documents.multipage_pdf(tmp_path / "report.pdf"), want_pictures=True)
    page_2 = pages[1].markdown
    assert page_2.count("<!-- image -->") == 1
    assert page_2.index(documents.CUT_SENTENCE[1]) < page_2.index("<!-- image -->") < page_2.index(documents.CAPTION)
    (picture,) = pages[1].pictures
    assert (picture.width, picture.height, picture.dpi) == (240, 150, 72)
    assert picture.bbox == {"l": 72.0, "t": 672.0, "r": 312.0, "b": 522.0, "coord_origin": "BOTTOMLEFT"}
    assert picture.page_size == {"width": 612.0, "height": 792.0}
    assert picture.ref == "#/pictures/0"
    with Image.open(io.BytesIO(picture.png)) as image:
        assert (image.format, image.size) == ("PNG", (240, 150))
        assert image.convert("RGB").getpixel((30, 130)) != (255, 255, 255)  # a bar, not the background
    assert pages[0].pictures == [] and pages[2].pictures == []


def test_it_leaves_the_pictures_out_unless_asked(engine: DoclingEngine, tmp_path: Path) -> None:
    _, pages = convert(engine, documents.multipage_pdf(tmp_path / "report.pdf"))
    assert pages[1].pictures == [] and "<!-- image -->" in pages[1].markdown


def test_the_joined_pdf_mends_the_sentence_and_the_list_across_breaks(engine: DoclingEngine, tmp_path: Path) -> None:
    _, pages = convert(engine, documents.multipage_pdf(tmp_path / "report.pdf"))
    joined = join_pages([p.markdown for p in pages])
    assert " ".join(documents.CUT_SENTENCE) in joined
    steps = "\n".join(f"{i}. {step}" for i, step in enumerate(documents.STEPS, 1))
    assert steps in joined


def test_it_converts_only_the_selected_pages(engine: DoclingEngine, tmp_path: Path) -> None:
    doc, pages = convert(engine, documents.long_pdf(tmp_path / "long.pdf", 6), pages=[3, 4, 5])
    assert doc.page_count == 6
    assert [p.page for p in pages] == [3, 4, 5]
    assert all(p.markdown.startswith(f"Page {p.page} heading Line 0 of page {p.page} says") for p in pages)
    assert all(p.ms > 0 for p in pages)


def test_ocr_reads_a_scanned_page(engine: DoclingEngine, tmp_path: Path) -> None:
    _, (page,) = convert(engine, documents.scanned_pdf(tmp_path / "scan.pdf", SCANNED_TEXT), want_pictures=True)
    assert page.ocr
    for words in ("Invoice number 4711", "Total due: 120 euros"):
        assert words in page.markdown
    # The scan is the page the text came from, not a picture on it.
    assert page.pictures == [] and "<!-- image -->" not in page.markdown


def test_ocr_false_leaves_a_scanned_page_as_its_picture(engine: DoclingEngine, tmp_path: Path) -> None:
    _, (page,) = convert(
        engine, documents.scanned_pdf(tmp_path / "scan.pdf", SCANNED_TEXT), ocr=False, want_pictures=True
    )
    assert not page.ocr
    assert page.markdown == "<!-- image -->"
    assert [(p.width, p.height) for p in page.pictures] == [documents.text_image(SCANNED_TEXT).size]


def test_ocr_reads_an_image_input(engine: DoclingEngine, tmp_path: Path) -> None:
    doc, (page,) = convert(engine, documents.png_file(tmp_path / "scan.png", SCANNED_TEXT))
    assert (doc.format, doc.page_count, doc.pipeline) == ("image", 1, "ocr")
    assert page.ocr and page.markdown == "Invoice number 4711\n\nTotal due: 120 euros"


def test_it_converts_a_docx_with_its_heading_table_and_picture(engine: DoclingEngine, tmp_path: Path) -> None:
    doc, (page,) = convert(engine, documents.docx_file(tmp_path / "plan.docx"), want_pictures=True)
    assert (doc.format, doc.page_count, doc.pipeline) == ("docx", 1, "simple")
    assert page.page == 1 and page.tables == 1
    assert page.markdown.startswith("## Project Plan\n\nThe server ships in three stages over one quarter.")
    rows = [line.replace(" ", "") for line in page.markdown.split("\n") if line.startswith("|")]
    assert rows[0] == "|Task|Owner|" and rows[2:] == ["|Build|Ana|", "|Test|Ben|"]
    assert page.markdown.index("| Test") < page.markdown.index("<!-- image -->")
    (picture,) = page.pictures
    assert (picture.width, picture.height) == (240, 150)


def test_it_converts_html(engine: DoclingEngine, tmp_path: Path) -> None:
    doc, (page,) = convert(engine, documents.html_file(tmp_path / "page.html"))
    assert (doc.format, doc.pipeline) == ("html", "simple")
    assert page.markdown.startswith("# Inference Server\n\nIt serves **chat** and speech.")
    assert "- chat\n- speech" in page.markdown and page.tables == 1


def test_json_output_is_the_pages_docling_document(engine: DoclingEngine, tmp_path: Path) -> None:
    _, pages = convert(engine, documents.multipage_pdf(tmp_path / "report.pdf"), want_json=True)
    page_1 = pages[0].json
    assert page_1 is not None and page_1["schema_name"] == "DoclingDocument"
    assert list(page_1["pages"]) == ["1"]
    assert page_1["texts"][0]["text"] == documents.TITLE and page_1["texts"][0]["label"] == "section_header"
    assert len(pages[1].json["pictures"]) == 1  # type: ignore[index]


def test_a_cancelled_conversion_stops_before_the_next_page(engine: DoclingEngine, tmp_path: Path) -> None:
    path = documents.long_pdf(tmp_path / "long.pdf", 8)
    doc = engine.open_document(path, path.name, max_pages=100)
    cancel = threading.Event()
    seen = []
    with pytest.raises(Cancelled):
        for page in engine.convert_pages(
            doc, list(range(1, 9)), ocr=True, want_json=False, want_pictures=False, cancel=cancel
        ):
            seen.append(page.page)
            if page.page == 2:
                cancel.set()
    engine.close_document(doc)
    assert seen == [1, 2]


@pytest.mark.parametrize(
    ("build", "name", "reason"),
    [
        (lambda p: p.write_bytes(b"") and p, "empty.pdf", "empty"),
        (lambda p: p.write_bytes(b"\x00\x01\x02binary junk\xff\xfe" * 50) and p, "junk.bin", "Unsupported format"),
        (lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 64) and p, "broken.docx", "damaged zip"),
        (documents.truncated_pdf, "cut.pdf", "truncated"),
        (lambda p: p.write_bytes(b"%PDF-1.4\n1 0 obj garbage\n%%EOF\n") and p, "bad.pdf", "corrupt"),
        (documents.encrypted_pdf, "secret.pdf", "encrypted"),
        (documents.zip_bomb_docx, "bomb.docx", "zip bomb"),
    ],
)
def test_it_refuses_bad_input_naming_the_file(
    engine: DoclingEngine, tmp_path: Path, build: object, name: str, reason: str
) -> None:
    path = build(tmp_path / name)  # type: ignore[operator]
    with pytest.raises(InvalidRequest) as refused:
        engine.open_document(path, name, max_pages=100)
    assert refused.value.param == "file"
    assert reason in refused.value.message


def test_it_refuses_more_pages_than_allowed(engine: DoclingEngine, tmp_path: Path) -> None:
    path = documents.long_pdf(tmp_path / "long.pdf", 4)
    with pytest.raises(InvalidRequest, match="4 pages, more than the limit of 3") as refused:
        engine.open_document(path, path.name, max_pages=3)
    assert refused.value.param == "file"


def test_it_refuses_a_docx_that_is_not_one(engine: DoclingEngine, tmp_path: Path) -> None:
    path = tmp_path / "fake.docx"
    with zipfile.ZipFile(path, "w") as fake:
        fake.writestr("word/document.xml", "<not-word/>")
    with pytest.raises(InvalidRequest, match="cannot be read") as refused:
        engine.open_document(path, path.name, max_pages=100)
    assert refused.value.param == "file"


def test_it_sniffs_the_format_from_the_bytes_not_the_name(engine: DoclingEngine, tmp_path: Path) -> None:
    path = documents.multipage_pdf(tmp_path / "report.docx")
    doc = engine.open_document(path, "report.docx", max_pages=100)
    engine.close_document(doc)
    assert doc.format == "pdf"


def test_warm_and_cool_hold_the_onnx_files_in_memory(engine: DoclingEngine) -> None:
    assert engine.loaded and engine.warm_bytes == engine.footprint().weights_bytes > 10 << 20


def test_a_zip_bomb_whose_directory_lies_is_refused_without_inflating_it(engine: DoclingEngine, tmp_path: Path) -> None:
    """The directory passes the size checks; a whole-part read would inflate all 256 MiB before
    zipfile cuts it to the declared 2,000 bytes, so the engine reads every part in small pieces
    first: the CRC does not match and the document is a 400, the process no bigger."""
    import resource

    path = documents.lying_zip_bomb_docx(tmp_path / "liar.docx")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidRequest) as refused:
        document = engine.open_document(path, path.name, max_pages=100)
        list(
            engine.convert_pages(
                document, [1], ocr=False, want_json=False, want_pictures=False, cancel=threading.Event()
            )
        )
    assert refused.value.param == "file" and "does not match its directory" in refused.value.message
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, f"the process grew {grown_mib:.0f} MiB"
