"""What an inference call said and answered, read from the request and the response only.

Plain logic, no database: which routes are inference calls, the text a call's input holds, the
usage, telemetry, error and output of a JSON or SSE response, the levels of spec §15 and the
operator's redaction. logs.middleware feeds it; the quota charge, the metrics and the request
log entry all come from the same reading.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

LEVELS = ("off", "error", "warn", "info", "debug", "trace")
# Each captured text field (input, output, payloads) keeps at most this many characters.
MAX_TEXT_CHARS = 32_768
REDACTED = "[redacted]"
# The finish_reason of a stream the client closed before its end.
CANCELLED = "cancelled"
# A /v1/responses body's terminal statuses, which stand for its finish_reason in the log.
RESPONSE_END_STATUSES = ("completed", "incomplete", "failed")

# The token-counting routes (spec and compat.md) under /v1 and /api/v1; a POST to one of them is
# an inference call: it is counted against the key's limits and recorded in the request log.
INFERENCE_ROUTES = frozenset({
    "chat/completions", "completions", "responses", "embeddings",
    "audio/transcriptions", "audio/translations", "audio/speech",
    "images/generations", "images/edits", "images/variations", "images/upscale",
    "documents/convert", "entities",
})


def inference_route(path: str) -> str | None:
    """`/v1/<route>` when `path` (under /v1 or /api/v1) is an inference route, else None."""
    rest = path.removeprefix("/api")
    if not rest.startswith("/v1/"):
        return None
    route = rest[len("/v1/"):].rstrip("/")
    return f"/v1/{route}" if route in INFERENCE_ROUTES else None


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def entry_level(status: int, error: str | None, cancelled: bool = False) -> str:
    """An entry's own level: error for 5xx and streams that ended in an error, warn for 4xx and
    calls the client gave up on."""
    if cancelled or 400 <= status < 500:
        return "warn"
    if status >= 500 or error:
        return "error"
    return "info"


def is_kept(entry: str, threshold: str) -> bool:
    """Whether the log at `threshold` keeps an entry of level `entry` (off keeps none)."""
    return threshold != "off" and level_rank(entry) <= level_rank(threshold)


class Redactor:
    """`request_log_redact`: None keeps text, "blank" empties it, a pattern masks its matches."""

    def __init__(self, rule: str | None):
        self.rule = rule
        self.pattern = re.compile(rule) if rule and rule != "blank" else None

    def __call__(self, text: str) -> str:
        if self.rule == "blank":
            return ""
        if self.pattern is not None:
            return self.pattern.sub(REDACTED, text)
        return text


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_content_text(part) for part in content)
    if isinstance(content, dict):
        if isinstance(content.get("text"), str):
            return content["text"]
        return _content_text(content.get("content"))
    return ""


def input_text(body: Any) -> str | None:
    """The text a call sends: its messages (one `role: text` line each), prompt, input or
    instructions. None when the body holds none of them."""
    if not isinstance(body, dict):
        return None
    lines: list[str] = []
    if isinstance(body.get("instructions"), str):
        lines.append(f"instructions: {body['instructions']}")
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            lines.append(f"{message.get('role', '?')}: {_content_text(message.get('content'))}")
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            lines.append(value)
        elif isinstance(value, list):
            lines += [v if isinstance(v, str) else _content_text(v) for v in value if not isinstance(v, int)]
    return "\n".join(lines) if lines else None


def json_body(raw: bytes) -> Any:
    """The JSON document `raw` holds, or None (also when it nests too deep to parse: the
    route's parser answers that body with a 400)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


@dataclass
class CapturedText:
    """A text field growing up to MAX_TEXT_CHARS; what does not fit is dropped and noted."""

    parts: list[str] = field(default_factory=list)
    size: int = 0
    truncated: bool = False

    def add(self, text: str) -> None:
        room = MAX_TEXT_CHARS - self.size
        if len(text) > room:
            text, self.truncated = text[:room], True
        if text:
            self.parts.append(text)
            self.size += len(text)

    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class ResponseReading:
    """Usage, telemetry, error, finish reason and output of one response, read as its body
    goes by. `deltas` counts the generated pieces a stream delivered (answer and thoughts):
    the worker streams one per token, so it stands for the completion tokens of a stream that
    ended before its usage chunk."""

    usage: dict[str, Any] | None = None
    telemetry: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    finish_reason: str | None = None
    output: CapturedText = field(default_factory=CapturedText)
    payload: CapturedText = field(default_factory=CapturedText)
    deltas: int = 0
    _pending: bytes = b""

    def read_json(self, raw: bytes) -> None:
        """A whole JSON body (a non-streaming answer or an error)."""
        self.payload.add(raw.decode("utf-8", errors="replace"))
        body = json_body(raw)
        if isinstance(body, dict):
            self._read_document(body)
            for choice in body.get("choices") or []:
                self._read_finish(choice)
                message = choice.get("message") if isinstance(choice, dict) else None
                if isinstance(message, dict):
                    self.output.add(_content_text(message.get("content")))
                elif isinstance(choice, dict) and isinstance(choice.get("text"), str):
                    self.output.add(choice["text"])
            if isinstance(body.get("output_text"), str):
                self.output.add(body["output_text"])
            if isinstance(body.get("text"), str):
                self.output.add(body["text"])

    def feed_sse(self, chunk: bytes | str) -> None:
        """A piece of an SSE body; events are read whole, however the pieces are cut."""
        data = chunk.encode() if isinstance(chunk, str) else chunk
        self.payload.add(data.decode("utf-8", errors="replace"))
        self._pending += data
        *events, self._pending = self._pending.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._read_event(line[5:].strip())

    def _read_event(self, data: bytes) -> None:
        event = json_body(data) if data != b"[DONE]" else None
        if not isinstance(event, dict):
            return
        self._read_document(event)
        if isinstance(event.get("response"), dict):
            self._read_document(event["response"])
        if event.get("type") == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.deltas += 1
            self.output.add(event["delta"])
        elif event.get("type") == "response.reasoning_text.delta" and event.get("delta"):
            self.deltas += 1
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            self._read_finish(choice)
            delta = choice.get("delta")
            text = _content_text(delta.get("content")) if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                self.deltas += 1
                self.output.add(text)
            elif isinstance(delta, dict) and delta.get("reasoning_content"):
                self.deltas += 1

    def _read_finish(self, choice: Any) -> None:
        if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]

    def _read_document(self, doc: dict[str, Any]) -> None:
        if isinstance(doc.get("usage"), dict):
            self.usage = doc["usage"]
        if isinstance(doc.get("hypnos_telemetry"), dict):
            self.telemetry = doc["hypnos_telemetry"]
        if doc.get("object") == "response" and doc.get("status") in RESPONSE_END_STATUSES:
            self.finish_reason = doc["status"]
        error = doc.get("error")
        if isinstance(error, dict):
            self.error = str(error.get("message") or error.get("type") or "error")
            self.error_type = error.get("type")

    # -- what was read -------------------------------------------------------------------------

    def tokens(self) -> tuple[int | None, int | None, int | None]:
        """Prompt, completion and cached tokens as the response's usage states them."""
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if prompt is not None and completion is None:
            completion = 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens", usage.get("cached_tokens"))
        return _int_or_none(prompt), _int_or_none(completion), _int_or_none(cached)

    def charged_tokens(self) -> int:
        """Prompt plus completion tokens; a stream cut before its usage chunk is charged its
        delivered deltas (about one token each)."""
        prompt, completion, _ = self.tokens()
        if prompt is None:
            return self.deltas
        return prompt + (completion or 0)

    def engine(self) -> dict[str, Any]:
        return (self.telemetry or {}).get("engine") or {}

    def tokens_per_s(self) -> float | None:
        rate = self.engine().get("decode_tokens_per_s")
        if rate is not None:
            return float(rate)
        _, completion, _ = self.tokens()
        inference_ms = (self.telemetry or {}).get("inference_latency_ms")
        if completion and inference_ms:
            return round(completion / (inference_ms / 1000), 1)
        return None


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
