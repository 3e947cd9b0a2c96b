"""The structured record of one inference call, filled by the serving code as the call runs.

logs.middleware creates it when a call arrives and hangs it on the Django request
(`request.hypnos_call`); the serving code (inference) fills it from the worker's typed events;
the quota charge, the metrics and the request log read it when the response's last byte is out.
Nothing re-reads the response bytes for usage. Plain data, no Django and no inference imports
(ARCHITECTURE.md: inference imports logs, never the other way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from logs.capture import CapturedText


@dataclass
class CallRecord:
    """What one call asked for and got: the pool id of its model, its usage, its telemetry."""

    # The pool's id of the requested model (an alias resolved), once the serving code knew it.
    model: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    cached_tokens: int | None = None
    # The worker's finish reason (stop, length, tool_calls); "cancelled" when the client left.
    finish_reason: str | None = None
    telemetry: dict[str, Any] | None = None
    # Speech and transcription: the audio's length, processing seconds per audio second, and
    # (speech) the time to its first audio.
    audio_secs: float | None = None
    rtf: float | None = None
    ttfa_ms: float | None = None
    # The modality the call ran (chat, embed, transcribe, speech): which metric families it feeds.
    work: str | None = None
    # Generated pieces delivered (answer and thoughts, about one token each): what a stream cut
    # before its end is charged.
    deltas: int = 0
    # The error the call ended with (a refusal, or a failure after a stream started).
    error: str | None = None
    error_type: str | None = None
    output: CapturedText = field(default_factory=CapturedText)
    # Pipeline stages a call ran before its own (chat input_audio transcribed first).
    stages: list[dict[str, Any]] = field(default_factory=list)

    def note_usage(self, prompt: int, completion: int, cached: int) -> None:
        self.tokens_in, self.tokens_out, self.cached_tokens = prompt, completion, cached

    def note_telemetry(self, telemetry: dict[str, Any]) -> None:
        self.telemetry = telemetry
        engine = telemetry.get("engine") or {}
        for name in ("audio_secs", "rtf", "ttfa_ms"):
            if isinstance(engine.get(name), (int, float)):
                setattr(self, name, float(engine[name]))

    def note_error(self, message: str, error_type: str | None) -> None:
        if self.error is None:
            self.error, self.error_type = message, error_type

    def engine(self) -> dict[str, Any]:
        return (self.telemetry or {}).get("engine") or {}

    def charged_tokens(self) -> int:
        """Prompt plus completion tokens; a stream cut before its end is charged its delivered
        deltas."""
        if self.tokens_in is None:
            return self.deltas
        return self.tokens_in + (self.tokens_out or 0)

    def tokens_per_s(self) -> float | None:
        rate = self.engine().get("decode_tokens_per_s")
        if isinstance(rate, (int, float)):
            return float(rate)
        inference_ms = (self.telemetry or {}).get("inference_latency_ms")
        if self.tokens_out and inference_ms:
            return round(self.tokens_out / (inference_ms / 1000), 1)
        return None
