"""The request log (spec §15): the latest inference calls, a ring buffer in the database."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils import timezone


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


# -- the picture store of document conversions (spec §12) -----------------------------------------


class StoredDocument(models.Model):
    """A conversion made with return_pictures: its pictures stay until `expires_at`, an explicit
    delete, or the store's size cap (oldest documents first). logs.pictures owns the rows and
    their files; deleting a row by other means leaves its files behind."""

    id = models.CharField(max_length=40, primary_key=True)
    # The label of the key that converted it (labels name keys everywhere, as in the request
    # log); null when no key was configured. Only that key and admin keys see the document.
    owner_label = models.CharField(max_length=100, null=True, blank=True)
    filename = models.CharField(max_length=255, blank=True, default="")
    model = models.CharField(max_length=200)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    # The pictures' bytes, kept here so the size cap is one sum, not a walk of the files.
    total_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name = "stored document"
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.id} {self.filename}".strip()


class StoredPicture(models.Model):
    """One picture of a StoredDocument; the image is the file at `file`, under data_dir."""

    document = models.ForeignKey(StoredDocument, on_delete=models.CASCADE, related_name="pictures")
    # 1-based, across the document in Markdown order (spec §12).
    index = models.PositiveIntegerField()
    page = models.PositiveIntegerField()
    mime = models.CharField(max_length=50, default="image/png")
    bytes = models.PositiveBigIntegerField()
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    dpi = models.PositiveIntegerField(null=True, blank=True)
    bbox = models.JSONField(null=True, blank=True)
    page_size = models.JSONField(null=True, blank=True)
    caption = models.TextField(null=True, blank=True)
    ref = models.TextField(null=True, blank=True)
    # Relative to data_dir, written by the store only: requests never name a file.
    file = models.CharField(max_length=300)

    class Meta:
        verbose_name = "stored picture"
        ordering = ["document", "index"]
        constraints = [models.UniqueConstraint(fields=["document", "index"], name="unique_picture_index")]

    def __str__(self) -> str:
        return f"{self.document_id} #{self.index}"


class StoredFile(models.Model):
    """A file of the Files API (POST /v1/files): a batch's input. Its bytes are the file at
    `file`, under data_dir/files; logs.files owns the rows and their files. Only the key that
    uploaded it and admin keys see it."""

    id = models.CharField(max_length=40, primary_key=True)
    # The uploading key's label; null when no key was configured (then every caller sees it).
    owner_label = models.CharField(max_length=100, null=True, blank=True, db_index=True)
    purpose = models.CharField(max_length=20)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(db_index=True)
    # Relative to data_dir, written by the store only: requests never name a file.
    file = models.CharField(max_length=300)

    class Meta:
        verbose_name = "stored file"
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.id} {self.filename}"


class Batch(models.Model):
    """A batch of the Batch API (POST /v1/batches): an input file of requests to one endpoint, run
    line by line as a Celery job (inference/jobs/batches.py) into an output and an error file.
    Its status and counts are OpenAI's; `cancel_requested` is set by POST .../cancel and read by
    the job before each line, as is `expires_at` (past it, the batch ends expired)."""

    STATUSES = [
        (s, s)
        for s in (
            "validating",
            "in_progress",
            "finalizing",
            "completed",
            "failed",
            "cancelling",
            "cancelled",
            "expired",
        )
    ]

    id = models.CharField(max_length=40, primary_key=True)
    owner_label = models.CharField(max_length=100, null=True, blank=True, db_index=True)
    endpoint = models.CharField(max_length=40)
    input_file_id = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=10, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=12, choices=STATUSES, default="validating")
    # Why the batch failed as a whole (OpenAI's `errors.data`), else null.
    errors = models.JSONField(null=True, blank=True)
    output_file_id = models.CharField(max_length=40, blank=True)
    error_file_id = models.CharField(max_length=40, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # The model the job is running lines for now ("" between models and when not running).
    current_model = models.CharField(max_length=200, blank=True)
    cancel_requested = models.BooleanField(default=False)
    # Until when the job that runs the batch holds it (renewed while it runs): a second delivery
    # of its task (Celery redelivers an unacknowledged one) waits instead of running lines twice.
    lease_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_index=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.id} {self.status} {self.completed + self.failed}/{self.total}"


class JobRow(models.Model):
    """What every long job's row holds (inference/jobs/feed.py reads and writes these): its state,
    who asked, the cancel flag a client that left sets, the error, and its times."""

    STATES = [(s, s) for s in ("queued", "running", "done", "failed", "cancelled")]

    id = models.CharField(max_length=40, primary_key=True)
    request_id = models.CharField(max_length=64)
    model = models.CharField(max_length=200)
    # The label of the API key that asked ("" with no keys configured).
    owner = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=12, choices=STATES, default="queued")
    # What the request asked for (the job's spec model, inference/jobs/documents.py, inference/jobs/images.py).
    spec = models.JSONField(default=dict)
    # Set by the web process when the client left; the job stops at its next unit of work.
    cancel_requested = models.BooleanField(default=False)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    @property
    def duration_ms(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.finished_at or timezone.now()
        return round((end - self.started_at).total_seconds() * 1000, 1)


class DocumentJob(JobRow):
    """A document conversion run by Celery, for the operator: what it converts, its state,
    pages done and duration. Its Celery task has the same id (django-celery-results keeps the
    task's own state and result)."""

    filename = models.CharField(max_length=255, blank=True)
    pages_total = models.IntegerField(null=True)
    pages_done = models.IntegerField(default=0)
    document_id = models.CharField(max_length=64, blank=True)

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} {self.state} {self.pages_done}/{self.pages_total or '?'}"


class ImageJob(JobRow):
    """Images made by Celery (spec §11: generations, edits, variations, upscales), for the
    operator: what it makes, its state, images done of n and duration. Its Celery task has the
    same id."""

    OPS = [(op, op) for op in ("generate", "edit", "variation", "upscale")]

    op = models.CharField(max_length=12, choices=OPS, default="generate")
    images_total = models.IntegerField(default=1)
    images_done = models.IntegerField(default=0)

    class Meta(JobRow.Meta):
        pass

    def __str__(self) -> str:
        return f"{self.id} {self.op} {self.state} {self.images_done}/{self.images_total}"
