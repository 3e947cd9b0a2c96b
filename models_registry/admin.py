from __future__ import annotations

from django.contrib import admin, messages

from models_registry.authentication import db_keys_present
from models_registry.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "label", "key_prefix", "admin", "active", "requests_per_minute", "max_concurrent", "tokens_per_day",
        "allowed_models", "created",
    ]
    list_filter = ["admin", "active"]
    readonly_fields = ["key_prefix", "created"]
    search_fields = ["label"]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if not change:
            key = obj.set_new_key()
            messages.warning(request, f"The new key is {key} — copy it now, it is not shown again.")
        super().save_model(request, obj, form, change)
        db_keys_present.invalidate()
