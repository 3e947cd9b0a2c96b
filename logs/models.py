"""The request log (spec §15): the latest inference calls, a ring buffer in the database."""

from __future__ import annotations

from typing import Any

from django.db import models


class RequestLogEntry(models.Model):
    request_id = models.CharField(max_length=40, unique=True)
    route = models.CharField(max_length=100)
    method = models.CharField(max_length=10)
    status = models.PositiveSmallIntegerField()
    # The key's label; the key itself is never stored.
    key_label = models.CharField(max_length=100, null=True, blank=True)
    started_at = models.DateTimeField()
    duration_ms = models.FloatField()
    model = models.CharField(max_length=200, blank=True, default="")
    stream = models.BooleanField(default=False)
    tokens_in = models.PositiveIntegerField(null=True, blank=True)
    tokens_out = models.PositiveIntegerField(null=True, blank=True)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    inference_ms = models.FloatField(null=True, blank=True)
    tier_switch_ms = models.FloatField(null=True, blank=True)
    previous_tier = models.CharField(max_length=20, blank=True, default="")
    error = models.TextField(blank=True, default="")
    # The answer's finish_reason (a /v1/responses call: its final status); "cancelled" when
    # the client closed the connection before the end.
    finish_reason = models.CharField(max_length=20, blank=True, default="")
    # The entry's own level: error (5xx or a stream that ended in an error), warn (4xx), info.
    level = models.CharField(max_length=8)
    truncated = models.BooleanField(default=False)
    # Captured text: input and output at level debug, the payloads at trace.
    input = models.TextField(null=True, blank=True)
    output = models.TextField(null=True, blank=True)
    request_payload = models.TextField(null=True, blank=True)
    response_payload = models.TextField(null=True, blank=True)

    class Meta:
        verbose_name = "request log entry"
        verbose_name_plural = "request log"
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.method} {self.route} {self.status}"

    def as_record(self) -> dict[str, Any]:
        """The record of spec §15; the captured-text fields only when they were captured."""
        record: dict[str, Any] = {
            "id": self.request_id,
            "route": self.route,
            "method": self.method,
            "status": self.status,
            "key": self.key_label,
            "started_at": self.started_at.isoformat().replace("+00:00", "Z"),
            "duration_ms": self.duration_ms,
            "model": self.model or None,
            "stream": self.stream,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "cached_tokens": self.cached_tokens,
            "tokens_per_s": self.tokens_per_s,
            "inference_ms": self.inference_ms,
            "tier_switch_ms": self.tier_switch_ms,
            "previous_tier": self.previous_tier or None,
            "error": self.error or None,
            "finish_reason": self.finish_reason or None,
            "level": self.level,
            "truncated": self.truncated,
        }
        for name in ("input", "output", "request_payload", "response_payload"):
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        return record
