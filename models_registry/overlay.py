"""The model pool overlay: run-time pool changes kept in the database (ModelOverlay) and laid
over the config file's models at the next start."""

from __future__ import annotations

import logging

from django.db import DatabaseError

from hypnos_site.config import HypnosConfig, ModelConfig
from models_registry.models import ModelOptions, ModelOverlay
from models_registry.options import apply
from models_registry.pool import PoolCheckFailed, model_from_block

log = logging.getLogger(__name__)


def with_overlay(config: HypnosConfig) -> HypnosConfig:
    """`config` with the overlay's changes applied: the pool the worker starts with. A row that
    no longer validates is skipped with a log line (the operator fixes it in the admin); without
    a reachable or migrated database the config file's pool is used as it is."""
    try:
        rows = list(ModelOverlay.objects.all())
        options = {row.model_id: row.options for row in ModelOptions.objects.all()}
    except DatabaseError as exc:
        log.warning("the model pool overlay could not be read (%s); serving the config file's models", exc)
        return config
    return config.model_copy(update={"models": overlay_models(config.models, rows, options)})


def overlay_models(
    models: list[ModelConfig], rows: list[ModelOverlay], options: dict[str, dict[str, object]] | None = None
) -> list[ModelConfig]:
    """The pool: `models` changed by the overlay's rows, each with its saved options."""
    pool = {model.id: model for model in models}
    for row in rows:
        if row.action == ModelOverlay.REMOVED:
            pool.pop(row.model_id, None)
            continue
        try:
            pool[row.model_id] = model_from_block(row.block, row.model_id)
        except PoolCheckFailed as exc:
            log.error("overlay entry %s is skipped: %s", row.model_id, exc)
    for model_id, saved in (options or {}).items():
        if model_id in pool:
            try:
                pool[model_id] = apply(pool[model_id], saved)
            except PoolCheckFailed as exc:
                log.error("the saved options of %s are skipped: %s", model_id, exc)
    return list(pool.values())


def base_model(config: HypnosConfig, model_id: str) -> ModelConfig | None:
    """The model as its block describes it, before saved options: the overlay's block, else
    the config file's."""
    row = ModelOverlay.objects.filter(model_id=model_id).first()
    if row is not None:
        return None if row.action == ModelOverlay.REMOVED else model_from_block(row.block, model_id)
    return next((m for m in config.models if m.id == model_id), None)


def saved_options(model_id: str) -> dict[str, object]:
    row = ModelOptions.objects.filter(model_id=model_id).first()
    return dict(row.options) if row else {}


def save_options(model_id: str, options: dict[str, object]) -> bool:
    """Keep the model's saved options (none: forget them); False when the database refused."""
    try:
        if options:
            ModelOptions.objects.update_or_create(model_id=model_id, defaults={"options": options})
        else:
            ModelOptions.objects.filter(model_id=model_id).delete()
    except DatabaseError:
        log.exception("the options of %s could not be persisted", model_id)
        return False
    return True


def save_change(config: HypnosConfig, model_id: str, block: str | None, source: str = "") -> bool:
    """Record a pool change (block None: removed); False when the database refused it."""
    in_file = any(model.id == model_id for model in config.models)
    try:
        if block is None and not in_file:
            ModelOverlay.objects.filter(model_id=model_id).delete()
        else:
            action = ModelOverlay.REMOVED if block is None else ModelOverlay.REPLACED if in_file else ModelOverlay.ADDED
            ModelOverlay.objects.update_or_create(
                model_id=model_id, defaults={"action": action, "block": block or "", "source": source}
            )
    except DatabaseError:
        log.exception("the pool change of %s could not be persisted", model_id)
        return False
    return True
