"""One page's positioned text lines and pictures -> a DoclingDocument in reading order.

The model-free paths (a PDF's text layer, OCR of a scan) give lines with boxes but no layout:
docling's NativePdfPipeline emits one paragraph per line and the pictures after all the text.
This puts the items top to bottom, joins the lines of a paragraph, and marks what the lines
themselves show: a line set clearly larger than the body is a heading, "1." / "-" lines are
list items. Boxes are in page units with the origin top-left."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from docling_core.types.doc import (
    BoundingBox,
    CoordOrigin,
    DocItemLabel,
    DoclingDocument,
    GroupItem,
    ImageRef,
    ProvenanceItem,
    Size,
)
from PIL import Image

# A line this much taller than the page's median line is a heading.
HEADING_RATIO = 1.4
# Lines of one paragraph are closer than this many median line heights.
PARAGRAPH_GAP = 0.8
ENUMERATED = re.compile(r"^(\d{1,3}[.)])\s+(.*)$")
BULLET = re.compile(r"^([-•▪*–])\s+(.*)$")


@dataclass
class Box:
    l: float  # noqa: E741 (docling's own names for the sides)
    t: float
    r: float
    b: float

    @property
    def height(self) -> float:
        return self.b - self.t

    @property
    def area(self) -> float:
        return max(self.r - self.l, 0) * max(self.b - self.t, 0)


@dataclass
class Line:
    text: str
    box: Box


@dataclass
class Figure:
    image: Image.Image | None
    box: Box
    dpi: int


def page_document(
    name: str, page_no: int, width: float, height: float, lines: list[Line], figures: list[Figure]
) -> DoclingDocument:
    """The page as a DoclingDocument of its own (the worker streams pages one by one)."""
    doc = DoclingDocument(name=name)
    doc.add_page(page_no=page_no, size=Size(width=width, height=height))
    body = statistics.median(line.box.height for line in lines) if lines else 0.0
    items: list[Line | Figure] = sorted([*lines, *figures], key=lambda item: (round(item.box.t), item.box.l))
    builder = _Builder(doc, page_no, height, body)
    for item in items:
        builder.add(item)
    builder.flush()
    return doc


class _Builder:
    """Adds the sorted items, holding the paragraph or list that is still growing."""

    def __init__(self, doc: DoclingDocument, page_no: int, page_height: float, body: float):
        self.doc, self.page_no, self.page_height, self.body = doc, page_no, page_height, body
        self.paragraph: list[Line] = []
        self.list_group: GroupItem | None = None
        self.list_enumerated = False

    def add(self, item: Line | Figure) -> None:
        if isinstance(item, Figure):
            self.flush()
            self.doc.add_picture(image=_image_ref(item), prov=self._prov(item.box, 0))
            return
        if self.body and item.box.height >= HEADING_RATIO * self.body:
            self.flush()
            self.doc.add_heading(item.text, level=1, prov=self._prov(item.box, len(item.text)))
        elif match := ENUMERATED.match(item.text) or BULLET.match(item.text):
            self._list_item(item, match, enumerated=bool(ENUMERATED.match(item.text)))
        else:
            self._paragraph_line(item)

    def _list_item(self, line: Line, match: re.Match[str], enumerated: bool) -> None:
        self._flush_paragraph()
        if self.list_group is None or self.list_enumerated != enumerated:
            self.list_group = self.doc.add_list_group()
            self.list_enumerated = enumerated
        marker, text = match.group(1), match.group(2)
        self.doc.add_list_item(
            text, enumerated=enumerated, marker=marker, parent=self.list_group, prov=self._prov(line.box, len(text))
        )

    def _paragraph_line(self, line: Line) -> None:
        self.list_group = None
        if self.paragraph and not self._continues(self.paragraph[-1], line):
            self._flush_paragraph()
        self.paragraph.append(line)

    def _continues(self, previous: Line, line: Line) -> bool:
        gap = line.box.t - previous.box.b
        similar = abs(line.box.height - previous.box.height) <= 0.25 * max(previous.box.height, 1e-6)
        return similar and gap < PARAGRAPH_GAP * self.body

    def flush(self) -> None:
        self._flush_paragraph()
        self.list_group = None

    def _flush_paragraph(self) -> None:
        if not self.paragraph:
            return
        text = join_lines([line.text for line in self.paragraph])
        box = Box(
            min(line.box.l for line in self.paragraph),
            self.paragraph[0].box.t,
            max(line.box.r for line in self.paragraph),
            self.paragraph[-1].box.b,
        )
        self.doc.add_text(label=DocItemLabel.TEXT, text=text, orig=text, prov=self._prov(box, len(text)))
        self.paragraph = []

    def _prov(self, box: Box, chars: int) -> ProvenanceItem:
        # Provenance boxes are bottom-left, as docling's PDF pipelines write them.
        bbox = BoundingBox(l=box.l, t=box.t, r=box.r, b=box.b, coord_origin=CoordOrigin.TOPLEFT)
        return ProvenanceItem(
            page_no=self.page_no, bbox=bbox.to_bottom_left_origin(self.page_height), charspan=(0, chars)
        )


def join_lines(lines: list[str]) -> str:
    """The lines of one paragraph as one string; a word hyphenated at a line end is rejoined."""
    text = lines[0].strip()
    for line in lines[1:]:
        line = line.strip()
        if text.endswith("-") and line[:1].islower():
            text = text[:-1] + line
        else:
            text = f"{text} {line}"
    return text


def _image_ref(figure: Figure) -> ImageRef | None:
    return ImageRef.from_pil(figure.image, dpi=figure.dpi) if figure.image is not None else None
