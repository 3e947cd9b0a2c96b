from __future__ import annotations

from django.contrib import admin

from logs.models import RequestLogEntry


@admin.register(RequestLogEntry)
class RequestLogEntryAdmin(admin.ModelAdmin):
    """Read-only: entries are written by the server only."""

    list_display = [
        "started_at",
        "request_id",
        "route",
        "status",
        "key_label",
        "model",
        "tokens_in",
        "tokens_out",
        "duration_ms",
        "level",
    ]
    list_filter = ["route", "status", "level", "key_label"]
    search_fields = ["request_id", "model"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False
