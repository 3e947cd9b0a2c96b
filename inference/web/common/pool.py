"""The web process's view of the model pool, and the routes that change it (spec §6).

The worker owns the pool: models can be added, replaced and removed while it runs, so the web
process reads the pool from the worker's status instead of its own config. In the embedded
deployment that is the in-process worker itself, always current; in the distributed one a copy
refreshed at most every POOL_TTL_SECS, and at once when a request names a model the copy lacks.
"""

from __future__ import annotations

import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest, ModelNotFound
from inference.transport.client import InferenceClient, InProcessTransport
from inference.transport.runtime import runtime
from models_registry import options as model_options
from models_registry.catalog import Catalog, catalog_path, load_catalog
from models_registry.pool import PoolCheckFailed, block_from_catalog, check_model, model_from_block

POOL_TTL_SECS = 1.0


class PoolView:
    def __init__(self) -> None:
        self._models: list[ModelConfig] | None = None
        self._fetched = 0.0

    def models(self) -> list[ModelConfig]:
        """The pool as last seen (the config file's models before the worker first answered)."""
        worker = _in_process_worker()
        if worker is not None:
            return [runtime.config for runtime in list(worker.models.values())]
        return self._models if self._models is not None else list(settings.HYPNOS.models)

    def find(self, name: str) -> ModelConfig:
        model = next((m for m in self.models() if name in (m.id, *m.aliases)), None)
        if model is None:
            raise ModelNotFound(f"The model {name!r} does not exist; GET /v1/models lists the models.", param="model")
        return model

    def names(self, name: str) -> set[str]:
        """`name` with the id and aliases of the model it names, if any."""
        for model in self.models():
            if name in (model.id, *model.aliases):
                return {model.id, *model.aliases}
        return {name}

    async def ensure(self, client: InferenceClient, name: str | None = None) -> None:
        """Bring the copy up to date when it is stale or lacks `name`."""
        if isinstance(client.transport, InProcessTransport):
            return
        known = name is None or any(name in (m.id, *m.aliases) for m in self.models())
        if known and time.monotonic() - self._fetched < POOL_TTL_SECS:
            return
        status = await client.status()
        if status is not None:
            self.update(status)

    def update(self, status: dict[str, Any]) -> None:
        """Take the pool from a worker status."""
        self._models = [ModelConfig.model_validate(state["config"]) for state in status["models"].values()]
        self._fetched = time.monotonic()

    def invalidate(self) -> None:
        self._fetched = 0.0


pool = PoolView()


def _in_process_worker() -> Any:
    """The worker the process's client talks to in-process (embedded deployment), if any."""
    return runtime.in_process_worker()


def _catalog() -> Catalog | None:
    path = catalog_path(settings.HYPNOS)
    return load_catalog(path) if path.exists() else None


def _checked_model(body: dict[str, Any], model_id: str | None) -> tuple[ModelConfig, str, str]:
    """The body's model after the startup checks, its block and its catalog spec (file reads:
    called off the event loop)."""
    catalog = _catalog()
    spec = body.get("catalog")
    if isinstance(spec, str) == isinstance(body.get("config"), str):
        raise InvalidRequest('Send either catalog ("<id>[:<quant>]") or config (one [[models]] block as TOML).')
    try:
        block = block_from_catalog(catalog, spec) if isinstance(spec, str) else body["config"]
        model = check_model(settings.HYPNOS, model_from_block(block, model_id), catalog)
    except PoolCheckFailed as exc:
        raise InvalidRequest(
            "The model cannot join the pool: " + "; ".join(exc.reasons) + ".",
            param="catalog" if isinstance(spec, str) else "config",
        ) from exc
    return model, block, spec or ""


def _drain_secs(value: object) -> float:
    try:
        drain = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidRequest("drain_secs must be a number of seconds.", param="drain_secs") from None
    if not 0 <= drain <= 3600:
        raise InvalidRequest("drain_secs must be between 0 and 3600.", param="drain_secs")
    return drain


async def _persist(model_id: str, block: str | None, spec: str = "") -> bool:
    from models_registry.overlay import save_change

    return await sync_to_async(save_change)(settings.HYPNOS, model_id, block, spec)


async def _with_saved_options(model: ModelConfig) -> ModelConfig:
    from models_registry.overlay import saved_options

    try:
        return model_options.apply(model, await sync_to_async(saved_options)(model.id))
    except PoolCheckFailed as exc:
        raise InvalidRequest("The model's saved options do not fit it: " + "; ".join(exc.reasons) + ".") from exc


async def add_model(client: InferenceClient, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/models: the model joins the pool, cold; 400 when a check fails or its id is taken."""
    model, block, spec = await sync_to_async(_checked_model)(body, None)
    model = await _with_saved_options(model)
    result = await client.control("add_model", {"config": model.model_dump(mode="json")})
    pool.invalidate()
    return {**result, "persisted": await _persist(model.id, block, spec)}


async def replace_model(client: InferenceClient, model_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """PUT /v1/models/{id}: the body's model takes the id once the old one has drained."""
    await pool.ensure(client, model_id)
    current = pool.find(model_id)
    model, block, spec = await sync_to_async(_checked_model)(body, current.id)
    model = await _with_saved_options(model)
    payload = {
        "model": current.id,
        "config": model.model_dump(mode="json"),
        "drain_secs": _drain_secs(body.get("drain_secs", 120)),
    }
    result = await client.control("replace_model", payload)
    pool.invalidate()
    return {**result, "persisted": await _persist(current.id, block, spec)}


async def remove_model(client: InferenceClient, model_id: str, drain_secs: object) -> dict[str, Any]:
    """DELETE /v1/models/{id}: out of the pool once drained; its name then answers 404."""
    await pool.ensure(client, model_id)
    current = pool.find(model_id)
    result = await client.control("remove_model", {"model": current.id, "drain_secs": _drain_secs(drain_secs)})
    pool.invalidate()
    return {**result, "persisted": await _persist(current.id, None)}


async def get_options(client: InferenceClient, model_id: str) -> dict[str, Any]:
    """GET /v1/models/{id}/options: defaults < config < saved, and the effective result."""
    base, saved = await _options_of(client, model_id)
    return model_options.layers(base, saved)


async def set_options(client: InferenceClient, model_id: str, body: dict[str, Any] | None) -> dict[str, Any]:
    """POST /v1/models/{id}/options (body: options to merge, null removing one, plus dry_run
    and drain_secs) and DELETE (body None: forget every saved option). The running model takes
    the result at once: in place for sampling, priority and initial tier, else reloaded after
    a drain."""
    from models_registry.overlay import save_options

    base, saved = await _options_of(client, model_id)
    changes = dict(body or {})
    dry_run = bool(changes.pop("dry_run", False))
    drain_secs = _drain_secs(changes.pop("drain_secs", 120))
    for echo in ("model_name", "model"):  # Lemonade's clients name the model in the body too
        if echo in changes and changes.pop(echo) not in (model_id, base.id):
            raise InvalidRequest(f"The body's {echo} is not {base.id!r}, the model of the path.", param=echo)
    try:
        saved = model_options.merge(saved, changes) if body is not None else {}
        trained = await sync_to_async(model_options.trained_context_len)(settings.HYPNOS, base)
        model_options.check_context(saved, trained)
        model = model_options.apply(base, saved)
    except PoolCheckFailed as exc:
        raise InvalidRequest("The options cannot be saved: " + "; ".join(exc.reasons) + ".") from exc
    answer = {**model_options.layers(base, saved), "dry_run": dry_run}
    if dry_run:
        return answer
    result = await client.control(
        "update_model", {"model": base.id, "config": model.model_dump(mode="json"), "drain_secs": drain_secs}
    )
    pool.invalidate()
    persisted = await sync_to_async(save_options)(base.id, saved)
    return {**answer, "action": result["action"], "persisted": persisted}


async def _options_of(client: InferenceClient, model_id: str) -> tuple[ModelConfig, dict[str, Any]]:
    """The model as its block describes it (before options) and its saved options."""
    from models_registry.overlay import base_model, saved_options

    await pool.ensure(client, model_id)
    current = pool.find(model_id)
    base = await sync_to_async(base_model)(settings.HYPNOS, current.id)
    return base or current, await sync_to_async(saved_options)(current.id)
