"""What the request log keeps of an inference call, read from the request.

Plain logic, no database: which routes are inference calls, the text a call's input holds, the
levels of spec §15, the operator's redaction and the capped text fields. What the call answered
(usage, telemetry, error, output) is in its record (logs.record.CallRecord), never read back
from the response's bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hypnos_site.json_bodies import too_many_values

LEVELS = ("off", "error", "warn", "info", "debug", "trace")
# Each captured text field (input, output, payloads) keeps at most this many characters.
MAX_TEXT_CHARS = 32_768
REDACTED = "[redacted]"
# The finish_reason of a stream the client closed before its end.
CANCELLED = "cancelled"

# The token-counting routes (spec and compat.md) under /v1 and /api/v1; a POST to one of them is
# an inference call: it is counted against the key's limits and recorded in the request log.
INFERENCE_ROUTES = frozenset(
    {
        "chat/completions",
        "completions",
        "responses",
        "embeddings",
        "audio/transcriptions",
        "audio/translations",
        "audio/speech",
        "images/generations",
        "images/edits",
        "images/variations",
        "images/upscale",
        "documents/convert",
        "entities",
        # Anthropic's Messages API (issue 17); counting tokens loads and runs the model's tokenizer.
        "messages",
        "messages/count_tokens",
    }
)


# The Ollama API's inference routes (issue 17), called by their own paths.
OLLAMA_INFERENCE_ROUTES = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})


def inference_route(path: str) -> str | None:
    """`/v1/<route>` when `path` (under /v1 or /api/v1) is an inference route, the path itself
    for one of Ollama's, else None."""
    if path.rstrip("/") in OLLAMA_INFERENCE_ROUTES:
        return path.rstrip("/")
    rest = path.removeprefix("/api")
    if not rest.startswith("/v1/"):
        return None
    route = rest[len("/v1/") :].rstrip("/")
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
    """The JSON document `raw` holds, or None (also when it nests too deep to parse, or holds
    more than a body may: the route's parser answers that body with a 400)."""
    if too_many_values(raw):
        return None
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
