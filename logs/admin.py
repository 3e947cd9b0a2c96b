from __future__ import annotations

from django.contrib import admin
from django.db.models import Count

from logs.models import Batch, DocumentJob, ImageJob, RequestLogEntry, StoredDocument, StoredFile, StoredPicture


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the server writes: the admin lists them and never adds or edits one."""

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


class NoDeleteAdmin(admin.ModelAdmin):
    """Rows with files beside them (the picture store): deleting one here would leave its files."""

    def has_delete_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(RequestLogEntry)
class RequestLogEntryAdmin(ReadOnlyAdmin):
    """Read-only: entries are written by the server only. The list fits a normal screen: seven
    short columns, long values cut (the entry's page has them whole), no navigation sidebar
    (its template); the key and the level are filters."""

    list_display = ["started", "call", "status", "short_model", "tokens", "duration", "short_error"]
    list_display_links = ["started", "call"]
    list_filter = ["route", "status", "level", "key_label"]
    search_fields = ["request_id", "model"]
    change_list_template = "admin/logs/requestlogentry/change_list.html"

    @admin.display(description="started (UTC)", ordering="started_at")
    def started(self, entry: RequestLogEntry) -> str:
        return entry.started_at.strftime("%m-%d %H:%M:%S")

    @admin.display(description="call", ordering="route")
    def call(self, entry: RequestLogEntry) -> str:
        return f"{entry.method} {_cut(entry.route, 40)}"

    @admin.display(description="model", ordering="model")
    def short_model(self, entry: RequestLogEntry) -> str:
        return _cut(entry.model, 24)

    @admin.display(description="tokens in / out")
    def tokens(self, entry: RequestLogEntry) -> str:
        if entry.tokens_in is None and entry.tokens_out is None:
            return "-"
        return f"{entry.tokens_in or 0} / {entry.tokens_out or 0}"

    @admin.display(description="duration (ms)", ordering="duration_ms")
    def duration(self, entry: RequestLogEntry) -> str:
        return f"{entry.duration_ms:.0f}"

    @admin.display(description="error")
    def short_error(self, entry: RequestLogEntry) -> str:
        return _cut(entry.error, 40)


def _cut(text: str | None, length: int) -> str:
    """The text on one line, at most `length` characters, an ellipsis where it was cut."""
    flat = " ".join((text or "").split())
    return flat if len(flat) <= length else flat[: length - 1] + "\u2026"


@admin.register(StoredDocument)
class StoredDocumentAdmin(ReadOnlyAdmin, NoDeleteAdmin):
    """Read-only: the picture store writes and deletes documents with their files (logs.pictures);
    a row deleted here would leave its files behind."""

    list_display = [
        "id",
        "filename",
        "model",
        "owner_label",
        "created_at",
        "expires_at",
        "picture_count",
        "total_bytes",
    ]
    list_filter = ["model", "owner_label"]
    search_fields = ["id", "filename"]

    def get_queryset(self, request):  # type: ignore[no-untyped-def]
        return super().get_queryset(request).annotate(picture_count=Count("pictures"))

    @admin.display(description="pictures", ordering="picture_count")
    def picture_count(self, document: StoredDocument) -> int:
        return document.picture_count  # type: ignore[attr-defined]


@admin.register(StoredFile)
class StoredFileAdmin(ReadOnlyAdmin, NoDeleteAdmin):
    """The Files API's files (logs.files writes and deletes them with their bytes): who uploaded
    what, for which purpose, and how large."""

    list_display = ["id", "filename", "purpose", "owner_label", "bytes", "created_at"]
    list_filter = ["purpose", "owner_label"]
    search_fields = ["id", "filename"]


@admin.register(StoredPicture)
class StoredPictureAdmin(ReadOnlyAdmin, NoDeleteAdmin):
    """Read-only, like the documents."""

    list_display = ["document", "index", "page", "width", "height", "bytes", "caption"]
    search_fields = ["document__id", "caption"]


@admin.register(DocumentJob)
class DocumentJobAdmin(ReadOnlyAdmin):
    """Read-only: the long jobs with their state, pages done and duration (the jobs write them)."""

    list_display = [
        "created_at",
        "id",
        "state",
        "model",
        "filename",
        "owner",
        "pages_done",
        "pages_total",
        "job_duration_ms",
        "error",
    ]
    list_filter = ["state", "model"]
    search_fields = ["id", "request_id", "filename"]

    @admin.display(description="duration (ms)")
    def job_duration_ms(self, job: DocumentJob) -> float | None:
        return job.duration_ms


@admin.register(ImageJob)
class ImageJobAdmin(ReadOnlyAdmin):
    """Read-only: the image jobs with their state, images done of n and duration."""

    list_display = [
        "created_at",
        "id",
        "op",
        "state",
        "model",
        "owner",
        "images_done",
        "images_total",
        "job_duration_ms",
        "error",
    ]
    list_filter = ["state", "op", "model"]
    search_fields = ["id", "request_id"]

    @admin.display(description="duration (ms)")
    def job_duration_ms(self, job: ImageJob) -> float | None:
        return job.duration_ms


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin, NoDeleteAdmin):
    """The Batch API's batches (inference/jobs/batches.py runs them): progress, the model a
    running batch holds, the files it read and wrote, and why one failed."""

    list_display = [
        "id",
        "status",
        "endpoint",
        "owner_label",
        "progress",
        "completed",
        "failed",
        "current_model",
        "created_at",
    ]
    list_filter = ["status", "endpoint", "owner_label"]
    search_fields = ["id", "input_file_id", "output_file_id", "error_file_id"]

    @admin.display(description="lines done")
    def progress(self, batch: Batch) -> str:
        return f"{batch.completed + batch.failed}/{batch.total}"
