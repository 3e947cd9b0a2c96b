"""GET /v1/models: the configured pool with what the worker reports about each model."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from inference.client import InferenceClient

CREATED = 1_767_225_600  # 2026-01-01, a fixed `created` for configured models


async def list_models(client: InferenceClient) -> dict[str, Any]:
    status = await client.status()
    states = (status or {}).get("models", {})
    data = []
    for model in settings.HYPNOS.models:
        if not model.enabled:
            continue
        state = states.get(model.id, {})
        data.append(
            {
                "id": model.id,
                "object": "model",
                "created": CREATED,
                "owned_by": "hypnos",
                "modality": model.modality,
                "aliases": model.aliases,
                "current_tier": state.get("current_tier"),
                "placement": state.get("placement"),
                "active_leases": state.get("active_leases", 0),
            }
        )
    return {"object": "list", "data": data}
