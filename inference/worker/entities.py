"""The worker's entity extraction (spec §13): on a GLiNER engine, or on a chat model whose block
lists `entity_extraction` among its additional modalities.

A chat model answers, greedily and after one worked example, `{"entities": [{"text": ...,
"label": ...}]}` under a JSON-schema grammar whose `label` is an enum of the request's labels.
The server, not the model, finds each returned text in the input, so every offset slices the
input to the entity's text, a text the model invented is dropped, and each mention of a
repeated entity gets its own offsets. A span's score is the mean probability the model gave the
tokens that wrote its text and its label (from the logits before the grammar's mask): how sure
the model was of writing exactly that entity with that label.

Everything that can refuse the request (a prompt beyond the context, a grammar the limits
refuse) is checked for every text before `started`."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypnos_site.config import LimitsConfig, ModelConfig
from hypnos_site.errors import Cancelled, InvalidRequest
from inference.engines.base import ChatWork
from inference.transport.entities import CANDIDATES_PER_WORD, Span, best_candidates, select_spans
from inference.transport.wire import Done, EntitiesFound, EntityWork, Started, Usage

if TYPE_CHECKING:
    from inference.engines.base import Engine
    from inference.worker.runtime import Lease, ModelRuntime
    from inference.worker.tier_moves import TierMoves, TierSwitch

# An event carries at most this many spans (the channel layer caps a message near 1 MB).
SPANS_PER_EVENT = 2000
SYSTEM_PROMPT = (
    "You extract named entities from a text: every entity of one of the given labels, with its "
    "label, written exactly as in the text, character for character. Reply with the JSON object only."
)
# The answer's room: about 12 tokens of JSON around each entity, a few entities per sentence.
ANSWER_TOKENS_BASE = 64
ANSWER_CHARS_PER_TOKEN = 2


def check_entity_model(config: ModelConfig) -> None:
    if "entity_extraction" not in config.modalities:
        raise InvalidRequest(
            f"The model {config.id!r} serves {', '.join(config.modalities)}, not entity_extraction (/v1/entities).",
            param="model",
        )


def serve_entities(
    moves: TierMoves,
    runtime: ModelRuntime,
    engine: Engine,
    work: EntityWork,
    lease: Lease,
    sink: Any,
    queue_ms: float,
    limits: LimitsConfig,
) -> Done:
    """Bring the model to tier 1, extract, send each text's spans as an `entities` event, and
    return the terminal `done` with the spec's telemetry (§5)."""
    if runtime.config.engine == "gliner":
        switch = moves.ensure_tier1(runtime, runtime.config.context_len)
        sink(Started(previous_tier=str(switch.previous_tier)))
        started = time.perf_counter()
        with lease.generating():
            found = engine.extract(work.input, work.labels, work.threshold, work.flat, lease.cancel)
        timings: dict[str, Any] = {}
        usage = None
    else:
        extractor = ChatExtractor(
            engine, work, lease.cancel, lambda chat: moves.prepare_chat(runtime, engine, chat, limits)
        )
        switch = extractor.prepare() or moves.ensure_tier1(runtime, runtime.config.context_len)
        sink(Started(previous_tier=str(switch.previous_tier)))
        started = time.perf_counter()
        with lease.generating():
            found = [extractor.extract(index) for index in range(len(work.input))]
        timings = extractor.timings()
        usage = Usage(prompt_tokens=extractor.prompt_tokens, completion_tokens=extractor.completion_tokens)
    inference_ms = (time.perf_counter() - started) * 1000
    for index, spans in enumerate(found):
        for start in range(0, max(len(spans), 1), SPANS_PER_EVENT):
            sink(EntitiesFound(index=index, spans=spans[start : start + SPANS_PER_EVENT]))
    placement = moves.tiers.placement(runtime.config.id)
    texts_per_s = round(len(work.input) / (inference_ms / 1000), 2) if inference_ms > 0 else 0.0
    telemetry = switch.telemetry(
        placement, inference_ms, {"queue_ms": round(queue_ms, 1), "texts_per_s": texts_per_s, **timings}
    )
    if switch.phases:
        telemetry["tier_switch_phases"] = switch.phases.as_dict()
    return Done(usage=usage, telemetry=telemetry)


def entity_schema(labels: list[str]) -> dict[str, Any]:
    """An array of entities, each its text and its label (one of the labels: an enum)."""
    entity = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "label": {"enum": list(labels)}},
        "required": ["text", "label"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"entities": {"type": "array", "items": entity}},
        "required": ["entities"],
        "additionalProperties": False,
    }


def _turn(labels: list[str], text: str) -> dict[str, Any]:
    return {"role": "user", "content": f"Labels: {json.dumps(labels, ensure_ascii=False)}\nText: {text}"}


# One worked example before the text (the same for every request, so its tokens stay cached):
# with it the 0.5B model labels a product a product instead of the company that makes it.
EXAMPLE = [
    _turn(
        ["person", "city", "organization", "product", "date"],
        "Anna Schmidt flew from Berlin to Paris on Monday to present the Galaxy S24 for Samsung.",
    ),
    {
        "role": "assistant",
        "content": json.dumps(
            {
                "entities": [
                    {"text": "Anna Schmidt", "label": "person"},
                    {"text": "Berlin", "label": "city"},
                    {"text": "Paris", "label": "city"},
                    {"text": "Monday", "label": "date"},
                    {"text": "Galaxy S24", "label": "product"},
                    {"text": "Samsung", "label": "organization"},
                ]
            }
        ),
    },
]


def extraction_messages(text: str, labels: list[str]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, _turn(labels, text)]


@dataclass
class _Answer:
    text: str
    # Each sampled token's [start, end) in the UTF-8 bytes of `text` and its probability.
    tokens: list[tuple[int, int, float]]

    def score(self, *pieces: tuple[int, int]) -> float:
        """The mean probability of the tokens that wrote the pieces text[start:end] (0 when
        none did); a token that wrote into two pieces counts once."""
        chosen: dict[int, float] = {}
        for start, end in pieces:
            byte_start = len(self.text[:start].encode())
            byte_end = byte_start + len(self.text[start:end].encode())
            for index, (t_start, t_end, probability) in enumerate(self.tokens):
                if t_start < byte_end and byte_start < t_end:
                    chosen[index] = probability
        return sum(chosen.values()) / len(chosen) if chosen else 0.0


class ChatExtractor:
    """Entity extraction on a chat engine, one greedy answer per text."""

    def __init__(
        self,
        engine: Engine,
        work: EntityWork,
        cancel: threading.Event,
        prepare_chat: Callable[[ChatWork], tuple[ChatWork, TierSwitch]],
    ):
        """`prepare_chat` brings the model to tier 1 with room for a chat and prepares it (the
        worker's TierMoves.prepare_chat, or a stand-in where no worker runs: bench/entities.py)."""
        self.engine, self.work, self.cancel, self.prepare_chat = engine, work, cancel, prepare_chat
        self.schema = entity_schema(work.labels)
        # None for a blank text: nothing to ask the model.
        self.prepared: list[ChatWork | None] = []
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.prefill_ms = self.decode_ms = 0.0

    def prepare(self) -> TierSwitch | None:
        """Every text's chat prepared (tokenised, its grammar built, its context checked); what
        moving the model cost (None when every text is blank: nothing asked the model)."""
        switch: TierSwitch | None = None
        for text in self.work.input:
            self.check_cancel()
            if not text.strip():
                self.prepared.append(None)
                continue
            chat = ChatWork(
                messages=extraction_messages(text, self.work.labels),
                max_tokens=self._answer_budget(text),
                temperature=0.0,
                json_schema=self.schema,
                top_logprobs=0,
                prompt_param="input",
                schema_param="labels",
            )
            prepared, moved = self.prepare_chat(chat)
            if switch is None:
                switch = moved
            else:
                switch.absorb(moved)
            self.prepared.append(prepared)
        return switch

    def _answer_budget(self, text: str) -> int:
        # An answer cut short still gives the entities it completed (answer_entities).
        return ANSWER_TOKENS_BASE + len(text) // ANSWER_CHARS_PER_TOKEN

    def check_cancel(self) -> None:
        """Between two texts: a request whose client left (or whose deadline passed) stops here,
        not after its thousandth text (once a core stayed busy 711 s after the client left)."""
        if self.cancel.is_set():
            raise Cancelled("the request was cancelled")

    def extract(self, index: int) -> list[Span]:
        self.check_cancel()
        chat = self.prepared[index]
        if chat is None:
            return []
        answer = self._answer(chat)
        text = self.work.input[index]
        # The same entity written twice counts once, at its best score; each is looked for once.
        scores: dict[tuple[str, str], float] = {}
        for entity in answer_entities(answer.text, set(self.work.labels)):
            # Rounded as the client sees it before the threshold is applied: a client that sends
            # a score back as its threshold keeps that entity.
            score = round(answer.score(entity.text_at, entity.label_at), 4)
            key = (entity.text.strip(), entity.label)
            if score >= self.work.threshold and score > scores.get(key, -1.0):
                scores[key] = score
        # Memory in proportion to the text, whatever the answer repeats (a short entity can
        # stand thousands of times in a long text).
        limit = CANDIDATES_PER_WORD * max(len(text.split()), 1)
        candidates: list[Span] = []
        for (value, label), score in scores.items():
            candidates += [Span(start=s, end=e, label=label, score=score) for s, e in find_mentions(text, value)]
            if len(candidates) > 2 * limit:
                candidates = best_candidates(candidates, limit)
        return select_spans(best_candidates(candidates, limit), self.work.flat)

    def _answer(self, chat: ChatWork) -> _Answer:
        pieces: list[str] = []
        tokens: list[tuple[int, int, float]] = []
        position = 0

        def on_delta(text: str, logprobs: list[dict[str, Any]] | None, reasoning: bool = False, /) -> None:
            nonlocal position
            if reasoning:
                return
            pieces.append(text)
            for entry in logprobs or []:
                size = len(entry["bytes"])
                tokens.append((position, position + size, math.exp(entry["logprob"])))
                position += size

        result = self.engine.chat(chat, self.cancel, on_delta)
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.completion_tokens
        self.cached_tokens += result.cached_tokens
        self.prefill_ms += result.prefill_ms
        self.decode_ms += result.decode_ms
        return _Answer("".join(pieces), tokens)

    def timings(self) -> dict[str, Any]:
        return {
            "prefill_ms": round(self.prefill_ms, 1),
            "decode_ms": round(self.decode_ms, 1),
            "cached_tokens": self.cached_tokens,
            "decode_tokens_per_s": round(self.completion_tokens / (self.decode_ms / 1000), 1)
            if self.decode_ms > 0
            else 0.0,
        }


_JSON_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([{}:,\[\]])')


@dataclass(frozen=True)
class AnswerEntity:
    """One entity of an answer: its text and label, and where each value lies in the answer."""

    text: str
    label: str
    text_at: tuple[int, int]
    label_at: tuple[int, int]


def answer_entities(answer: str, labels: set[str]) -> list[AnswerEntity]:
    """The entities of an answer `{"entities": [{"text": ..., "label": ...}, ...]}`, read token
    by token, so an answer cut short by its token budget still gives the ones it completed."""
    found: list[AnswerEntity] = []
    key: str | None = None
    fields: dict[str, tuple[str, int, int]] = {}
    after_colon = False
    for match in _JSON_TOKEN.finditer(answer):
        raw, punct = match.group(1), match.group(2)
        if punct == "{":
            fields, key, after_colon = {}, None, False
        elif punct == "}":
            if "text" in fields and "label" in fields:
                (text, *text_at), (label, *label_at) = fields["text"], fields["label"]
                if label in labels and text.strip():
                    found.append(AnswerEntity(text, label, (text_at[0], text_at[1]), (label_at[0], label_at[1])))
            fields = {}
        elif punct == ":":
            after_colon = True
        elif punct is not None:
            key, after_colon = None, False
        else:
            try:
                value = json.loads(f'"{raw}"')
            except json.JSONDecodeError:
                continue
            if after_colon and key is not None:
                fields[key] = (value, match.start(1), match.end(1))
                key, after_colon = None, False
            else:
                key = value
    return found


def find_mentions(text: str, value: str) -> list[tuple[int, int]]:
    """Every [start, end) where `value` stands in `text` as whole words (not inside a longer
    word); matched exactly, else ignoring case; none when the model made it up."""
    value = value.strip()
    if not value:
        return []
    before = r"(?<!\w)" if value[0].isalnum() or value[0] == "_" else ""
    after = r"(?!\w)" if value[-1].isalnum() or value[-1] == "_" else ""
    pattern = before + re.escape(value) + after
    for flags in (0, re.IGNORECASE):
        spans = [(m.start(), m.end()) for m in re.finditer(pattern, text, flags)]
        if spans:
            return spans
    return []
