"""A transcription's result: what Engine.transcribe returns and the worker sends back in its
`Done` (inference.transport.wire), below both so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(slots=True, frozen=True, kw_only=True)
class Word:
    word: str
    start: float
    end: float


@dataclass(slots=True, frozen=True, kw_only=True)
class Segment:
    """One transcript segment, with OpenAI's verbose_json fields."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Transcript:
    kind: Literal["transcript"] = "transcript"
    text: str
    language: str
    segments: list[Segment]
    duration_secs: float
