from __future__ import annotations

from typing import Any

from django.apps import AppConfig

from hypnos_site.config import ModelConfig


class ServingPool:
    """The pool the web process serves, installed into `models_registry.live_pool` so the apps
    below inference (the admin catalog page, key checks, the request log) reach it without
    importing inference. The imports are deferred: ready() runs in every process, and the
    serving modules need the settings it is called after."""

    def models(self) -> list[ModelConfig]:
        from inference.web.common.pool import pool

        return pool.models()

    async def add_model(self, body: dict[str, Any]) -> dict[str, Any]:
        from inference.transport.runtime import get_client
        from inference.web.common.pool import add_model

        return await add_model(get_client(), body)

    async def remove_model(self, model_id: str, drain_secs: object) -> dict[str, Any]:
        from inference.transport.runtime import get_client
        from inference.web.common.pool import remove_model

        return await remove_model(get_client(), model_id, drain_secs)


class InferenceConfig(AppConfig):
    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from PIL import Image

        from models_registry.live_pool import pool

        # Every process (web, worker, Celery) refuses to decode images above the configured
        # pixel cap, whatever path reaches Pillow (it raises above twice this, warns above it).
        Image.MAX_IMAGE_PIXELS = settings.HYPNOS.limits.max_image_pixels
        pool.install(ServingPool())
