from __future__ import annotations

from django.contrib import admin, messages

from models_registry.authentication import db_keys_present
from models_registry.models import ApiKey, ModelOverlay


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = [
        "label",
        "key_prefix",
        "admin",
        "active",
        "requests_per_minute",
        "max_concurrent",
        "tokens_per_day",
        "allowed_models",
        "created",
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


@admin.register(ModelOverlay)
class ModelOverlayAdmin(admin.ModelAdmin):
    """Run-time pool changes; an edit here takes effect at the next start (the running pool
    changes through POST/PUT/DELETE /v1/models)."""

    list_display = ["model_id", "action", "source", "updated"]
    # The catalog page (models_registry/admin_catalog.py) is linked from this list.
    change_list_template = "admin/models_registry/modeloverlay/change_list.html"
    list_filter = ["action"]
    search_fields = ["model_id", "source", "block"]
    readonly_fields = ["updated"]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        super().save_model(request, obj, form, change)
        messages.info(request, f"The change to {obj.model_id} applies at the next start of the server.")
