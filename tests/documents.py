"""Real test documents, built by the tests at run time (no binary fixtures in the repository).

PDFs are written with fpdf2, DOCX files with python-docx, pictures and scans with Pillow: the
documents a user would send, with a text layer where a word processor would put one, and none
where a scanner made the page."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from fpdf import FPDF
from PIL import Image, ImageDraw, ImageFont

TITLE = "Quarterly Report"
# The sentence cut by the break between pages 1 and 2 of multipage_pdf.
CUT_SENTENCE = (
    "The team shipped the new inference server to production and then",
    "measured its throughput on every model of the lineup.",
)
# The numbered list that runs from the bottom of page 2 onto page 3.
STEPS = ["Install the server.", "Load the models.", "Run the benchmark.", "Compare the figures."]
CAPTION = "Figure 1: revenue by quarter"


def chart_png(width: int = 240, height: int = 150) -> bytes:
    """A small bar chart as PNG: a picture with real pixels, unlike any page background."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for i, (value, colour) in enumerate([(60, "navy"), (95, "teal"), (80, "orange"), (130, "crimson")]):
        left = 20 + i * 55
        draw.rectangle([left, height - 10 - value, left + 35, height - 10], fill=colour)
    draw.line([10, height - 10, width - 10, height - 10], fill="black", width=2)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _pdf() -> FPDF:
    pdf = FPDF(unit="pt", format="letter")
    pdf.set_auto_page_break(False)
    pdf.set_font("Helvetica", size=12)
    return pdf


def _lines(pdf: FPDF, top: float, lines: list[str], gap: float = 16) -> float:
    for i, line in enumerate(lines):
        pdf.text(72, top + i * gap, line)
    return top + len(lines) * gap


def multipage_pdf(path: Path) -> Path:
    """Three Letter pages with a text layer: a title, a sentence cut by the first page break,
    a raster chart with its caption on page 2, and a numbered list running from page 2 to 3."""
    pdf = _pdf()
    pdf.add_page()
    pdf.set_font("Helvetica", style="B", size=24)
    pdf.text(72, 90, TITLE)
    pdf.set_font("Helvetica", size=12)
    _lines(pdf, 140, ["Revenue grew by twelve percent in the third quarter.", "Costs stayed flat."])
    _lines(pdf, 740, [CUT_SENTENCE[0]])
    pdf.add_page()
    _lines(pdf, 72, [CUT_SENTENCE[1]])
    pdf.image(io.BytesIO(chart_png()), x=72, y=120, w=240)
    _lines(pdf, 300, [CAPTION])
    _lines(pdf, 660, ["Steps to reproduce:", f"1. {STEPS[0]}", f"2. {STEPS[1]}"])
    pdf.add_page()
    _lines(pdf, 72, [f"3. {STEPS[2]}", f"4. {STEPS[3]}"])
    _lines(pdf, 140, ["The figures are in the appendix."])
    pdf.output(str(path))
    return path


def long_pdf(path: Path, pages: int) -> Path:
    """`pages` pages of plain paragraphs, for page selection, cancellation and timing."""
    pdf = _pdf()
    for number in range(1, pages + 1):
        pdf.add_page()
        _lines(pdf, 72, [f"Page {number} heading"] + [f"Line {i} of page {number} says something." for i in range(30)])
    pdf.output(str(path))
    return path


def text_image(text: str, width: int = 1200) -> Image.Image:
    """`text` drawn black on white at a size a 300 dpi scan of 12 pt print would have."""
    font = ImageFont.load_default(size=48)
    lines = text.split("\n")
    image = Image.new("RGB", (width, 120 + 80 * len(lines)), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((60, 60 + 80 * i), line, fill="black", font=font)
    return image


def scanned_pdf(path: Path, text: str) -> Path:
    """A one-page PDF whose only content is a picture of `text`: no text layer, as a scanner
    writes it."""
    image = text_image(text)
    pdf = FPDF(unit="pt", format="letter")
    pdf.add_page()
    pdf.image(image, x=36, y=36, w=540)
    pdf.output(str(path))
    return path


def scanned_pages_pdf(path: Path, pages: int) -> Path:
    """`pages` scanned pages (no text layer): each takes OCR about two seconds on 2 cores, slow
    enough for a client to leave in the middle."""
    pdf = FPDF(unit="pt", format="letter")
    for number in range(1, pages + 1):
        pdf.add_page()
        pdf.image(text_image(f"Scanned page {number}\nThe total is {number * 7} euros"), x=36, y=36, w=540)
    pdf.output(str(path))
    return path


def png_file(path: Path, text: str) -> Path:
    text_image(text).save(path, format="PNG")
    return path


def docx_file(path: Path) -> Path:
    """A Word document with a heading, a paragraph, a 3x2 table and the chart picture."""
    from docx import Document
    from docx.shared import Inches

    document = Document()
    document.add_heading("Project Plan", level=1)
    document.add_paragraph("The server ships in three stages over one quarter.")
    table = document.add_table(rows=3, cols=2)
    for row, cells in zip(table.rows, [("Task", "Owner"), ("Build", "Ana"), ("Test", "Ben")], strict=True):
        row.cells[0].text, row.cells[1].text = cells
    document.add_picture(io.BytesIO(chart_png()), width=Inches(2.5))
    document.add_paragraph("The chart above shows the budget.")
    document.save(str(path))
    return path


def html_file(path: Path) -> Path:
    path.write_text(
        "<!DOCTYPE html><html><head><title>Inference Server</title></head><body>"
        "<h1>Inference Server</h1><p>It serves <b>chat</b> and speech.</p>"
        "<ul><li>chat</li><li>speech</li></ul>"
        "<table><tr><th>Model</th><th>Size</th></tr><tr><td>smollm2</td><td>135M</td></tr></table>"
        "</body></html>",
        encoding="utf-8",
    )
    return path


def encrypted_pdf(path: Path) -> Path:
    """A PDF that opens only with its user password."""
    pdf = _pdf()
    pdf.add_page()
    _lines(pdf, 72, ["Secret figures."])
    pdf.set_encryption(owner_password="owner", user_password="secret")
    pdf.output(str(path))
    return path


def truncated_pdf(path: Path) -> Path:
    """The first half of a real PDF, as an interrupted download leaves it."""
    whole = multipage_pdf(path).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


def zip_bomb_docx(path: Path, inflated_bytes: int = 256 << 20) -> Path:
    """A DOCX-shaped zip whose document part inflates to `inflated_bytes` of zeros (a few
    hundred KB on disk)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        bomb.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types/>')
        with bomb.open("word/document.xml", "w", force_zip64=True) as part:
            chunk = b"\0" * (1 << 20)
            for _ in range(inflated_bytes // len(chunk)):
                part.write(chunk)
    return path


def lying_zip_bomb_docx(path: Path, inflated_bytes: int = 256 << 20) -> Path:
    """A real DOCX (docx_file) whose document part is replaced by one that inflates to
    `inflated_bytes`, and whose zip directory lies: it declares that part 2,000 bytes, so the
    size checks on the directory pass and python-docx goes on to read it."""
    name = "word/document.xml"
    real = docx_file(path.with_name("real-" + path.name))
    with zipfile.ZipFile(real) as source, zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        for member in source.infolist():
            if member.filename != name:
                bomb.writestr(member, source.read(member))
        with bomb.open(name, "w") as part:
            part.write(b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n')
            chunk = b" " * (1 << 20)
            for _ in range(inflated_bytes // len(chunk)):
                part.write(chunk)
    data = bytearray(path.read_bytes())
    # The part's central directory entry: its name at offset 46, its uncompressed size at 24.
    entry = data.find(b"PK\x01\x02")
    while data[entry + 46 : entry + 46 + len(name)] != name.encode():
        entry = data.find(b"PK\x01\x02", entry + 4)
    data[entry + 24 : entry + 28] = (2000).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path
