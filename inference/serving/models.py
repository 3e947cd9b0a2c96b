"""The model routes: GET /v1/models (and HEAD), GET /v1/models/{id}, its files, and
enable/disable (spec §6, compat.md), from the configured pool and what the worker reports."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from hypnos_site.config import ModelConfig
from inference.client import InferenceClient
from inference.errors import NotFound
from inference.serving.pool import pool
from models_registry.catalog import catalog_path, describe, disk_size, load_catalog

CREATED = 1_767_225_600  # 2026-01-01, a fixed `created` for configured models


def _model_object(model: ModelConfig, state: dict[str, Any]) -> dict[str, Any]:
    return {
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


def _enabled(model: ModelConfig, state: dict[str, Any]) -> bool:
    return bool(state.get("enabled", model.enabled))


async def _states(client: InferenceClient) -> dict[str, Any]:
    """Each model's state from the worker (which also refreshes the pool view)."""
    status = await client.status()
    if status is None:
        return {}
    pool.update(status)
    return status["models"]


async def list_models(client: InferenceClient) -> dict[str, Any]:
    """Models in service; disabled ones are hidden."""
    states = await _states(client)
    data = [_model_object(m, states.get(m.id, {})) for m in pool.models() if _enabled(m, states.get(m.id, {}))]
    return {"object": "list", "data": data}


async def get_model(client: InferenceClient, name: str) -> dict[str, Any]:
    states = await _states(client)
    model = pool.find(name)
    state = states.get(model.id, {})
    return {**_model_object(model, state), "enabled": _enabled(model, state)}


async def model_files(client: InferenceClient, name: str) -> dict[str, Any]:
    """GET /v1/models/{id}/files: the files the model block names, and whether they are there."""
    await pool.ensure(client, name)
    model = pool.find(name)
    files = [("weights", settings.HYPNOS.weights_file(model)), ("aux", settings.HYPNOS.aux_file(model))]
    return {"object": "list", "model": model.id, "data": [
        {"name": path.name, "role": role, "path": str(path), "size_bytes": disk_size(path) if path.exists() else None,
         "exists": path.exists()}
        for role, path in files if path is not None]}


def catalog(modality: str | None) -> dict[str, Any]:
    """GET /v1/models/catalog; 404 not_found when the server has no catalog file."""
    path = catalog_path(settings.HYPNOS)
    if not path.exists():
        raise NotFound("This server has no models.catalog.toml.")
    live = settings.HYPNOS.model_copy(update={"models": pool.models()})
    return describe(live, load_catalog(path), modality)


async def set_enabled(client: InferenceClient, name: str, enabled: bool) -> dict[str, Any]:
    await pool.ensure(client, name)
    pool.find(name)
    return await client.control("enable" if enabled else "disable", {"model": name})
