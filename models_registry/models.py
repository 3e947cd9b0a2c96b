"""API keys stored hashed; the clear key is shown once, when it is created."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models

KEY_PREFIX = "hyp_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def split_models(value: str) -> tuple[str, ...]:
    """The model names of a comma-separated list, blanks dropped."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


class ApiKey(models.Model):
    label = models.CharField(max_length=100, unique=True)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    # The first characters of the key, so an operator can tell keys apart in the admin.
    key_prefix = models.CharField(max_length=16, editable=False)
    admin = models.BooleanField(default=False, help_text="May change the model pool.")
    active = models.BooleanField(default=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, help_text="Calls in flight at once; a stream counts until its last byte."
    )
    tokens_per_day = models.PositiveIntegerField(
        null=True, blank=True, help_text="Prompt plus completion tokens per UTC day."
    )
    allowed_models = models.CharField(
        max_length=1000,
        blank=True,
        default="",
        help_text="Comma-separated model ids or aliases this key may use; blank = every model.",
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "API key"
        ordering = ["label"]

    def __str__(self) -> str:
        return f"{self.label} ({self.key_prefix}…)"

    def set_new_key(self) -> str:
        """Give this record a fresh random key and return it in clear (the only time it is)."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.key_hash = hash_key(key)
        self.key_prefix = key[:12]
        return key

    @classmethod
    def create_key(cls, label: str, **fields: object) -> tuple[ApiKey, str]:
        record = cls(label=label, **fields)
        key = record.set_new_key()
        record.save()
        return record, key

    def as_record(self) -> dict[str, object]:
        """GET /v1/keys's view of the key: never the key, only its first characters."""
        return {
            "id": self.pk,
            "label": self.label,
            "key_prefix": self.key_prefix,
            "admin": self.admin,
            "active": self.active,
            "requests_per_minute": self.requests_per_minute,
            "max_concurrent": self.max_concurrent,
            "tokens_per_day": self.tokens_per_day,
            "models": list(split_models(self.allowed_models)),
            "created": self.created.isoformat().replace("+00:00", "Z"),
            "source": "database",
        }


class ModelOverlay(models.Model):
    """A change to the model pool made while the server ran (POST/PUT/DELETE /v1/models). The
    overlay is applied on top of the config file at the next start; the file is never rewritten."""

    ADDED, REPLACED, REMOVED = "added", "replaced", "removed"

    model_id = models.CharField(max_length=200, unique=True)
    action = models.CharField(
        max_length=10,
        choices=[(ADDED, "added"), (REPLACED, "replaced (a config model)"), (REMOVED, "removed (a config model)")],
    )
    block = models.TextField(
        blank=True, help_text="The [[models]] block (TOML) the model runs with; its id is model_id. Empty when removed."
    )
    source = models.CharField(max_length=200, blank=True, help_text="The catalog spec the block came from, if any.")
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_id"]

    def __str__(self) -> str:
        return f"{self.model_id} ({self.action})"


class ModelOptions(models.Model):
    """A model's saved options (GET/POST/DELETE /v1/models/{id}/options): the top layer over
    the built-in defaults and the model's config block."""

    model_id = models.CharField(max_length=200, unique=True)
    options = models.JSONField(default=dict, blank=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "model options"
        verbose_name_plural = "model options"
        ordering = ["model_id"]

    def __str__(self) -> str:
        return self.model_id
