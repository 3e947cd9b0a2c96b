"""The per-page Markdown of a converted document joined into one text, mended across page
breaks (spec §12): a sentence cut by the break is one paragraph again, a numbered list keeps
counting, and a table split over two pages is one table. Pure text work, no Django and no
engine: the Celery task that collects the pages runs it."""

from __future__ import annotations

import re

NUMBERED = re.compile(r"^(\d{1,9})([.)])(\s+.*)$")
SEPARATOR_ROW = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
CELL_BORDER = re.compile(r"(?<!\\)\|")
# What ends a sentence, once closing quotes and brackets are set aside.
TERMINAL = (".", "!", "?", "…", ":")
CLOSERS = "\"'”’)]*_"
# A page that starts with one of these continues the sentence before the break.
CONTINUATION = re.compile(r"^[a-z,;)\]]")


def join_pages(pages: list[str]) -> str:
    """The pages' Markdown in order, blocks separated by a blank line, mended at each break."""
    joined = ""
    for page in pages:
        page = page.strip("\n")
        if page:
            joined = _mend(joined, page) if joined else page
    return joined


def _mend(before: str, after: str) -> str:
    head, last = _split_last(before)
    first, tail = _split_first(after)
    merged = _join_table(last, first) or _join_list(last, first) or _join_sentence(last, first)
    if merged is None:
        return f"{before}\n\n{after}"
    return "\n\n".join(part for part in (head, merged, tail) if part)


def _split_last(text: str) -> tuple[str, str]:
    head, _, last = text.rpartition("\n\n")
    return head, last


def _split_first(text: str) -> tuple[str, str]:
    first, _, tail = text.partition("\n\n")
    return first, tail


def _join_table(last: str, first: str) -> str | None:
    """One table when both sides are tables with the same column count; the second page's
    header row goes when it repeats the first's, its separator row always."""
    above, below = last.split("\n"), first.split("\n")
    if not (_is_table(above) and _is_table(below)) or _columns(above[0]) != _columns(below[0]):
        return None
    if len(below) > 1 and SEPARATOR_ROW.match(below[1].strip()):
        repeated = _cells(below[0]) == _cells(above[0])
        below = below[2:] if repeated else below[:1] + below[2:]
    return "\n".join(above + below)


def _is_table(lines: list[str]) -> bool:
    return bool(lines) and all(line.strip().startswith("|") for line in lines)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in CELL_BORDER.split(row.strip())[1:-1]]


def _columns(row: str) -> int:
    return len(_cells(row))


def _join_list(last: str, first: str) -> str | None:
    """One numbered list when the page ends inside one and the next starts with an item that
    restarts at 1 or goes on from the last number; restarted items are renumbered."""
    above, below = last.split("\n"), first.split("\n")
    previous = NUMBERED.match(above[-1])
    following = NUMBERED.match(below[0])
    if previous is None or following is None:
        return None
    number = int(previous.group(1))
    if int(following.group(1)) not in (1, number + 1):
        return None
    renumbered = []
    for line in below:
        item = NUMBERED.match(line)
        if item is not None:
            number += 1
            line = f"{number}{item.group(2)}{item.group(3)}"
        renumbered.append(line)
    return "\n".join(above + renumbered)


def _join_sentence(last: str, first: str) -> str | None:
    """One paragraph when the page ends mid-sentence and the next page goes on with it."""
    if not (_is_prose(last) and _is_prose(first)) or not CONTINUATION.match(first):
        return None
    ending = last.rstrip().rstrip(CLOSERS)
    if ending.endswith(TERMINAL):
        return None
    if last.endswith("-") and first[:1].islower():
        return last[:-1] + first
    return f"{last.rstrip()} {first.lstrip()}"


def _is_prose(block: str) -> bool:
    start = block.lstrip()
    return (
        bool(start) and not start.startswith(("#", "|", "<!--", "```", "- ", "* ", ">")) and not NUMBERED.match(start)
    )
