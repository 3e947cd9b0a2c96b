"""The model routes: GET /v1/models (and HEAD), GET /v1/models/{id}, its files, and
enable/disable (spec §6, compat.md), from the configured pool and what the worker reports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError

from hypnos_site.config import ModelConfig
from hypnos_site.errors import NotFound
from inference.transport.client import InferenceClient
from inference.web.common.pool import pool
from models_registry.catalog import catalog_path, describe, disk_size, load_catalog

CREATED = 1_767_225_600  # 2026-01-01, a fixed `created` for configured models
# What each modality gives a model picker to read (`capabilities`).
MODALITY_CAPABILITIES = {
    "text_generation": ("chat", "completion"),
    "vision": ("chat", "completion", "vision"),
    "speech_to_text": ("audio_in", "transcription"),
    "text_to_speech": ("audio_out", "speech"),
    "embeddings": ("embeddings",),
    "image_generation": ("images",),
    "document_conversion": ("documents",),
    "entity_extraction": ("entities",),
}
# Lemonade's recipe names, where one of its recipes runs the same engine.
RECIPES = {"ggml_llama": "llamacpp", "ggml_diffusion": "sd-cpp"}


def capabilities(model: ModelConfig, state: dict[str, Any]) -> list[str]:
    """What the model serves, for pickers: its modalities' capabilities (a chat model with a
    speech_to_text_model hears, `audio_in`, and does not transcribe); what its engine found in the
    weights once it exists (`tools`, `thinking`, `vision`); the image model's own (`edit`,
    `upscale`, `ignores_prompt`)."""
    found: list[str] = []
    for modality in model.modalities:
        if modality == "speech_to_text" and model.modality != "speech_to_text":
            found.append("audio_in")
        else:
            found += MODALITY_CAPABILITIES.get(modality, ())
    found += state.get("capabilities", [])
    found += model.image_capabilities
    return list(dict.fromkeys(found))


def _model_object(model: ModelConfig, state: dict[str, Any]) -> dict[str, Any]:
    weights = settings.HYPNOS.weights_file(model)
    found = {
        "id": model.id,
        "object": "model",
        "created": CREATED,
        "owned_by": "hypnos",
        "modality": model.modality,
        "aliases": model.aliases,
        "capabilities": capabilities(model, state),
        "context_length": model.context_len,
        "max_context_window": max(state.get("trained_context_len") or 0, model.context_len),
        "engine": model.engine,
        "checkpoint": model.weights_path,
        "downloaded": weights.exists(),
        "current_tier": state.get("current_tier"),
        "placement": state.get("placement"),
        "active_leases": state.get("active_leases", 0),
    }
    if model.engine in RECIPES:
        found["recipe"] = RECIPES[model.engine]
    return found


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
    """One model, with Lemonade's recipe_options: its saved options under both names, and the
    context it loads with as ctx_size even when none is saved."""
    from models_registry.options import lemonade_view
    from models_registry.overlay import saved_options

    states = await _states(client)
    model = pool.find(name)
    state = states.get(model.id, {})
    try:
        saved = await sync_to_async(saved_options)(model.id)
    except DatabaseError:  # the model is still described; only its saved options are unknown
        saved = {}
    return {
        **_model_object(model, state),
        "enabled": _enabled(model, state),
        "recipe_options": {"ctx_size": model.context_len, **lemonade_view(saved)},
    }


async def model_files(client: InferenceClient, name: str, *, admin: bool) -> dict[str, Any]:
    """GET /v1/models/{id}/files: the files the model block names, and whether they are there
    (`path` absolute for admin keys, relative to models_dir for the others)."""
    await pool.ensure(client, name)
    model = pool.find(name)
    files = [("weights", settings.HYPNOS.weights_file(model)), ("aux", settings.HYPNOS.aux_file(model))]
    return {
        "object": "list",
        "model": model.id,
        "data": [
            {
                "name": path.name,
                "role": role,
                "path": shown_path(path, admin),
                "size_bytes": disk_size(path) if path.exists() else None,
                "exists": path.exists(),
            }
            for role, path in files
            if path is not None
        ],
    }


def catalog(modality: str | None, *, admin: bool) -> dict[str, Any]:
    """GET /v1/models/catalog; 404 not_found when the server has no catalog file. `models_dir`
    is null for keys that are not admin keys."""
    path = catalog_path(settings.HYPNOS)
    if not path.exists():
        raise NotFound("This server has no models.catalog.toml.")
    live = settings.HYPNOS.model_copy(update={"models": pool.models()})
    described = describe(live, load_catalog(path), modality)
    return described if admin else {**described, "models_dir": None}


# -- what a key that is not an admin key sees of the server's file system -----------------------
# The server's absolute paths tell its user name and layout; only admin keys (and the open API)
# see them. Other keys see paths relative to models_dir, or a file's name when it lies elsewhere.


def shown_path(path: Path, admin: bool) -> str:
    """`path` as the caller may see it."""
    if admin:
        return str(path)
    try:
        return str(path.relative_to(settings.HYPNOS.models_dir))
    except ValueError:
        return path.name


def hide_paths(value: Any, admin: bool) -> Any:
    """`value` (a JSON document) with the server's absolute paths in its strings made relative
    (models_dir and the pool's files) or replaced by `~` (the home directory)."""
    if admin:
        return value
    replacements = _path_replacements()
    # A folder ends in "/"; a file or the home directory must end where the path's name does.
    pattern = re.compile("|".join(re.escape(p) + ("" if p.endswith("/") else r"(?![\w.+-])") for p in replacements))
    return _scrubbed(value, pattern, replacements)


def _path_replacements() -> dict[str, str]:
    """Absolute path -> what a key that is not an admin key sees instead, longest first (so a
    file's own path wins over the folder holding it)."""
    config = settings.HYPNOS
    found = {
        f"{config.models_dir}/": "",
        str(config.models_dir): "models_dir",
        f"{config.data_dir}/": "",
        str(config.data_dir): "data_dir",
    }
    for model in pool.models():
        for file in (config.weights_file(model), config.aux_file(model)):
            if file is not None:
                found.setdefault(str(file), shown_path(file, admin=False))
    found.setdefault(str(Path.home()), "~")
    return dict(sorted(found.items(), key=lambda item: len(item[0]), reverse=True))


def _scrubbed(value: Any, pattern: re.Pattern[str], replacements: dict[str, str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda match: replacements[match.group(0)], value)
    if isinstance(value, dict):
        return {key: _scrubbed(item, pattern, replacements) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrubbed(item, pattern, replacements) for item in value]
    return value


async def set_enabled(client: InferenceClient, name: str, enabled: bool) -> dict[str, Any]:
    await pool.ensure(client, name)
    pool.find(name)
    return await client.control("enable" if enabled else "disable", {"model": name})
