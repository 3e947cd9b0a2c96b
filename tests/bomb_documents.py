"""Documents that cost a converter far more than their size (issue 35), shared by
tests/integration/test_document_bombs.py and bench/bombs.py: PDFs written object by object, PNGs
row by row, DOCX parts replaced in a real python-docx document. Each is a few KB to a few MB,
built without ever holding the pixels or the inflated bytes it declares."""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from pathlib import Path

from docx import Document


def pdf_bytes(media_box: tuple[int, int], contents: bytes = b"", image: bytes = b"") -> bytes:
    """A one-page PDF with a correct xref; `image` (a whole XObject with its stream) is the
    page's /Im1. Without `contents` the page is blank, with no text layer (OCR renders it)."""
    resources = b"/Resources << /XObject << /Im1 5 0 R >> >> " if image else b""
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] " % media_box + resources + b"/Contents 4 0 R >>",
        b"<< /Length %d >>\nstream\n" % len(contents) + contents + b"\nendstream",
    ] + ([image] if image else [])
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def white_png(width: int, height: int) -> bytes:
    """An RGB PNG of white pixels (a few KB for millions of pixels)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    deflate = zlib.compressobj(9)
    row = b"\x00" + b"\xff" * (3 * width)
    pixels = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def docx_parts(picture: bytes | None = None) -> dict[str, bytes]:
    """The parts of a real one-paragraph DOCX from python-docx (with `picture` inline)."""
    out = io.BytesIO()
    document = Document()
    document.add_paragraph("Seed.")
    if picture is not None:
        document.add_picture(io.BytesIO(picture))
    document.save(out)
    with zipfile.ZipFile(out) as archive:
        return {member.filename: archive.read(member) for member in archive.infolist()}


def zip_bytes(parts: dict[str, bytes]) -> bytes:
    """`parts` deflated into a zip archive (a DOCX when they are a DOCX's)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in parts.items():
            archive.writestr(name, data)
    return out.getvalue()


def write_zip(path: Path, parts: dict[str, bytes]) -> Path:
    path.write_bytes(zip_bytes(parts))
    return path


def docx_body_bytes(body: str) -> bytes:
    """A real DOCX whose document body is `body` (WordprocessingML, prefix w:)."""
    parts = docx_parts()
    xml = parts["word/document.xml"]
    parts["word/document.xml"] = re.sub(rb"<w:body>.*</w:body>", f"<w:body>{body}</w:body>".encode(), xml, flags=re.S)
    return zip_bytes(parts)


def docx_with_body(path: Path, body: str) -> Path:
    """docx_body_bytes(body) written to `path`."""
    path.write_bytes(docx_body_bytes(body))
    return path


def lying_docx(path: Path, declared: int = 308, inflated: int = 512 << 20) -> Path:
    """A DOCX whose document part declares `declared` bytes and carries their CRC, a complete
    document.xml of that size, yet whose data inflates to `inflated` bytes (spaces after the
    document's root, so the part is still valid XML read whole)."""
    name = "word/document.xml"
    head = (
        b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
        b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
        b"<w:body><w:p><w:r><w:t>An honest-looking document.</w:t></w:r></w:p></w:body></w:document>"
    )
    shown = head + b" " * (declared - len(head))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for part, data in docx_parts().items():
            if part != name:
                archive.writestr(part, data)
        with archive.open(name, "w") as member:
            member.write(shown)
            spaces = b" " * (1 << 20)
            for _ in range((inflated - declared) // len(spaces)):
                member.write(spaces)
    data = bytearray(path.read_bytes())
    crc = struct.pack("<I", zlib.crc32(shown))
    size = struct.pack("<I", declared)
    # The local header (CRC at 14, size at 22) and the central directory entry (16, 24).
    for signature, crc_at, size_at, name_at in ((b"PK\x03\x04", 14, 22, 30), (b"PK\x01\x02", 16, 24, 46)):
        at = data.find(signature)
        while data[at + name_at : at + name_at + len(name)] != name.encode():
            at = data.find(signature, at + 4)
        data[at + crc_at : at + crc_at + 4] = crc
        data[at + size_at : at + size_at + 4] = size
    path.write_bytes(bytes(data))
    return path
