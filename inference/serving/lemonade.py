"""Lemonade's lifecycle routes (compat.md), mapped onto the tier manager."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from hypnos_site.errors import InvalidRequest, ModelNotAvailable, NotFound
from inference.client import InferenceClient
from inference.serving.chat import last_stats
from inference.serving.models import shown_path
from inference.serving.pool import pool


async def health(client: InferenceClient, *, admin: bool) -> dict[str, Any]:
    """GET /api/v1/health; `checkpoint` is absolute for admin keys, relative to models_dir for
    the others."""
    status = await client.status()
    if status is None:
        raise ModelNotAvailable("no inference worker is answering")
    pool.update(status)
    configs = {m.id: m for m in pool.models()}
    loaded = [
        {
            "model_name": model_id,
            "checkpoint": shown_path(settings.HYPNOS.weights_file(configs[model_id]), admin),
            "type": "llm" if configs[model_id].modality == "text_generation" else configs[model_id].modality,
            "device": "gpu" if state["placement"]["gpu_layers"] and not status.get("simulated", True) else "cpu",
            "recipe": configs[model_id].engine,
        }
        for model_id, state in status["models"].items()
        if state["current_tier"] == "tier1_gpu_vram" and model_id in configs
    ]
    return {
        "status": "ok",
        "model_loaded": loaded[-1]["model_name"] if loaded else None,
        "all_models_loaded": loaded,
        "websocket_port": settings.HYPNOS.server.port,
    }


async def load(client: InferenceClient, body: dict[str, Any]) -> dict[str, Any]:
    name = _model_name(body, required=True)
    payload = {"model": name, "target_tier": "tier1_gpu_vram", "context_len": body.get("ctx_size")}
    await client.control("move", payload)
    return {"status": "success", "message": f"Loaded model: {name}"}


async def unload(client: InferenceClient, body: dict[str, Any]) -> dict[str, Any]:
    name = _model_name(body, required=False)
    if name is not None:
        await client.control("move", {"model": name, "target_tier": "tier2_pinned_ram"})
        return {"status": "success", "message": f"Unloaded model: {name}"}
    status = await client.status() or {"models": {}}
    for model_id, state in status["models"].items():
        if state["current_tier"] == "tier1_gpu_vram":
            await client.control("move", {"model": model_id, "target_tier": "tier2_pinned_ram"})
    return {"status": "success", "message": "Unloaded all models"}


def stats() -> dict[str, Any]:
    if not last_stats:
        raise NotFound("No request has finished yet.")
    return dict(last_stats)


def _model_name(body: dict[str, Any], required: bool) -> str | None:
    name = body.get("model_name") or body.get("model")
    if name is None and required:
        raise InvalidRequest("model_name is required", param="model_name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest("model_name must be a string", param="model_name")
    return name
