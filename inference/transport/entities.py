"""Entity spans (spec §13): the span every extractor returns, and how a set of scored candidates
becomes the answer (flat or nested), shared by the GLiNER engine and the chat-model extractor.

Offsets count Unicode scalar values, which is what a Python `str` indexes: `text[start:end]` is
the entity's text."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

# GLiNER's prompt holds at most this many labels well; more run in families of this size.
LABELS_PER_FAMILY = 8
# The most candidates an extractor keeps per word of a text (the best first): a flat answer has
# at most one span per word, and a threshold of 0 would otherwise make every span of every
# width and label a candidate.
CANDIDATES_PER_WORD = 4


@dataclass(slots=True, frozen=True, kw_only=True)
class Span:
    """One entity: [start, end) in the text's characters, its label and score in [0, 1]."""

    start: int
    end: int
    label: str
    score: float

    def overlaps(self, other: Span) -> bool:
        return self.start < other.end and other.start < self.end

    def nests_with(self, other: Span) -> bool:
        """One lies wholly inside the other (and they are not the same characters)."""
        if (self.start, self.end) == (other.start, other.end):
            return False
        inside = other.start <= self.start and self.end <= other.end
        around = self.start <= other.start and other.end <= self.end
        return inside or around


def label_families(labels: list[str]) -> list[list[str]]:
    """The labels in families of LABELS_PER_FAMILY, in their order."""
    return [labels[i : i + LABELS_PER_FAMILY] for i in range(0, len(labels), LABELS_PER_FAMILY)]


def select_spans(candidates: Iterable[Span], flat: bool) -> list[Span]:
    """The answer from scored candidates, greedily by score (highest first; ties: the earlier,
    then the longer span). Flat keeps no two spans that share a character; nested also keeps a
    span wholly inside or around one already kept, never a partial overlap, and never the same
    characters under two labels. The same span found twice (windows, families) counts once, at
    its best score. Sorted by start, then end.

    Kept spans are indexed by the characters they cover, so each candidate is checked against
    only the kept spans it touches: the cost grows with the candidates' lengths, not with the
    product of candidates and kept spans."""
    best: dict[tuple[int, int, str], Span] = {}
    for span in candidates:
        key = (span.start, span.end, span.label)
        if key not in best or span.score > best[key].score:
            best[key] = span
    covering: dict[int, list[Span]] = {}
    kept: list[Span] = []
    for span in sorted(best.values(), key=rank):
        positions = range(span.start, span.end)
        if flat:
            free = not any(position in covering for position in positions)
        else:
            touched = {id(other): other for position in positions for other in covering.get(position, ())}
            free = all(span.nests_with(other) for other in touched.values())
        if free:
            kept.append(span)
            for position in positions:
                covering.setdefault(position, []).append(span)
    return sorted(kept, key=lambda s: (s.start, s.end, s.label))


def rank(span: Span) -> tuple[float, int, int, str]:
    """The order candidates are chosen in: the highest score first, then the earlier, then the
    longer span, then by label."""
    return (-span.score, span.start, span.start - span.end, span.label)


def best_candidates(candidates: list[Span], limit: int) -> list[Span]:
    """At most `limit` candidates, the first in `rank` order: what an extractor keeps of a text's
    candidates, so a request with a threshold near 0 holds memory in proportion to its text."""
    if len(candidates) <= limit:
        return candidates
    return heapq.nsmallest(limit, candidates, key=rank)
