"""Lemonade's lifecycle routes (compat.md), mapped onto the tier manager."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.config import ModelConfig
from hypnos_site.errors import HypnosError, InvalidRequest, ModelNotAvailable
from inference.transport.client import InferenceClient
from inference.web.common import pool as pool_changes
from inference.web.common import pulls
from inference.web.common.catalog import RECIPES, shown_path
from inference.web.common.generation import last_stats
from inference.web.common.pool import pool
from inference.web.common.render import sse_data, sse_response
from inference.web.lemonade.protocol import LemonadeLoadRequest, LemonadePullRequest
from models_registry.downloads import PlannedFile

# Lemonade's model types by Hypnos's modality (its /health and max_models name these).
LEMONADE_TYPES = {
    "text_generation": "llm",
    "vision": "llm",
    "embeddings": "embedding",
    "speech_to_text": "audio",
    "text_to_speech": "tts",
    "image_generation": "image",
    "document_conversion": "document",
    "entity_extraction": "entities",
}


async def health(client: InferenceClient, *, admin: bool) -> dict[str, Any]:
    """GET /api/v1/health: the models in tier 1 as Lemonade lists its loaded ones; `checkpoint`
    is absolute for admin keys, relative to models_dir for the others."""
    status = await client.status()
    if status is None:
        raise ModelNotAvailable("no inference worker is answering")
    pool.update(status)
    configs = {m.id: m for m in pool.models()}
    loaded = [
        _loaded(configs[model_id], state, status, admin)
        for model_id, state in status["models"].items()
        if state["current_tier"] == "tier1_gpu_vram" and model_id in configs
    ]
    return {
        "status": "ok",
        "model_loaded": loaded[-1]["model_name"] if loaded else None,
        "all_models_loaded": loaded,
        "max_models": _max_models(configs.values(), status.get("max_resident")),
        # The realtime socket is on this port too, at /realtime as on Lemonade's legacy port.
        "websocket_port": settings.HYPNOS.server.port,
    }


def _loaded(model: ModelConfig, state: dict[str, Any], status: dict[str, Any], admin: bool) -> dict[str, Any]:
    placement = state["placement"]
    return {
        "model_name": model.id,
        "checkpoint": shown_path(settings.HYPNOS.weights_file(model), admin),
        "type": LEMONADE_TYPES.get(model.modality, model.modality),
        "device": "gpu" if placement["gpu_layers"] and not status.get("simulated", True) else "cpu",
        "recipe": RECIPES.get(model.engine, model.engine),
        "recipe_options": {"ctx_size": placement.get("allocated_context_len") or model.context_len},
        # The process that runs the engine (the inference worker; the server itself when embedded).
        "pid": status.get("pid"),
        "is_busy": state.get("admitted", 0) > 0,
        "is_streaming": state.get("generating", 0) > 0,
        "telemetry": {
            "current_tier": state["current_tier"],
            "gpu_layers": placement["gpu_layers"],
            "active_leases": state.get("active_leases", 0),
            "loads": state.get("loads", 0),
            "expires_at": state.get("expires_at"),
        },
    }


def _max_models(models: Iterable[ModelConfig], max_resident: int | None) -> dict[str, int]:
    """Lemonade's per-type caps: as many as the pool has of the type (the memory budget decides
    which fit), at most hardware.max_resident_models (or POST /internal/set) where set."""
    counts = dict.fromkeys(("llm", "embedding", "reranking", "audio", "tts", "image"), 0)
    for model in models:
        kind = LEMONADE_TYPES.get(model.modality, model.modality)
        counts[kind] = counts.get(kind, 0) + 1
    cap = max_resident if max_resident is not None else max(counts.values(), default=0)
    return {kind: min(count, cap) for kind, count in counts.items()}


async def load(client: InferenceClient, body: LemonadeLoadRequest) -> dict[str, Any]:
    """Promote to tier 1 at `ctx_size` (the model's own without one); with `save_options` the
    context is saved as the model's option first, so every later load takes it."""
    name = body.name
    if body.save_options:
        await pool_changes.set_options(client, name, {"context_len": body.ctx_size})
    await client.control("move", {"model": name, "target_tier": "tier1_gpu_vram", "context_len": body.ctx_size})
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


async def delete(client: InferenceClient, body: dict[str, Any]) -> dict[str, Any]:
    """POST /api/v1/delete: as Ollama's DELETE /api/delete (out of the pool once its requests
    are done, then the files only it used), in Lemonade's answer."""
    name = _model_name(body, required=True)
    assert name is not None
    await pulls.remove(client, pool.find(name))
    return {"status": "success", "message": f"Deleted model: {name}"}


def stats() -> dict[str, Any]:
    return dict(last_stats)


def _model_name(body: dict[str, Any], required: bool) -> str | None:
    name = body.get("model_name") or body.get("model")
    if name is None and required:
        raise InvalidRequest("model_name is required", param="model_name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest("model_name must be a string", param="model_name")
    return name


async def pull(client: InferenceClient, body: LemonadePullRequest) -> HttpResponseBase:
    """POST /api/v1/pull: the same pull as Ollama's /api/pull (checks before any byte, resumed,
    verified, then added to the pool), answered as Lemonade answers: `{"status": "success"}`, or
    with `stream` its SSE events `progress` (per file), then `complete` or `error`."""
    entry, variant, planned = await asyncio.to_thread(pulls.plan_pull, body.model_name)
    name = f"{entry.id}:{variant.quant}"
    lines = pulls.pull_lines(client, planned, name)
    if not body.stream:
        async for _ in lines:
            pass
        return JsonResponse({"status": "success", "message": f"Installed model: {name}"})
    return sse_response(_pull_events(lines, planned, name))


async def _pull_events(
    lines: AsyncGenerator[dict[str, Any], None], planned: list[PlannedFile], name: str
) -> AsyncIterator[str]:
    files = {pulls.digest(item): (index, item) for index, item in enumerate(planned)}
    try:
        async for line in lines:
            if "digest" not in line:
                continue
            index, item = files[line["digest"]]
            done, total = line["completed"], line["total"]
            yield _event(
                "progress",
                {
                    "file": item.file.local,
                    "file_index": index + 1,
                    "total_files": len(planned),
                    "bytes_downloaded": done,
                    "bytes_total": total,
                    "percent": round(100 * done / total, 1) if total else 100.0,
                },
            )
        yield _event("complete", {"status": "success", "message": f"Installed model: {name}"})
    except HypnosError as error:
        yield _event("error", error.body())
    finally:
        await lines.aclose()


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\n" + sse_data(data)
