"""Changing the model pool while the worker runs (spec §6: POST /v1/models, PUT and DELETE
/v1/models/{id}).

Requests are routed by name, so a change is a swap of the name's runtime. A replacement or a
removal first drains the old model: requests that arrive meanwhile wait (they are resubmitted
when the change ends), the ones already admitted finish on the old engine, which is then unloaded.
Past `drain_secs` the change is refused with 429 and the old model stays in service.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest, ModelBusy
from memory.tiers import MemoryTier, Placement

if TYPE_CHECKING:
    from inference.worker.core import ModelRuntime, Sink, Worker

log = logging.getLogger(__name__)
DRAIN_POLL_SECS = 0.05
POOL_OPS = ("add_model", "replace_model", "remove_model", "update_model")


def change_pool(worker: Worker, op: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Carry out one pool operation; its result for the route."""
    if op == "add_model":
        return add_model(worker, ModelConfig.model_validate(payload["config"]))
    drain_secs = float(payload.get("drain_secs", 120))
    if op == "replace_model":
        return replace_model(worker, payload["model"], ModelConfig.model_validate(payload["config"]), drain_secs)
    if op == "update_model":
        return update_model(worker, payload["model"], ModelConfig.model_validate(payload["config"]), drain_secs)
    return remove_model(worker, payload["model"], drain_secs)


def add_model(worker: Worker, config: ModelConfig) -> dict[str, Any]:
    """Put a new model in the pool, cold in tier 3 (its first request loads it); 400 when its
    id or an alias is taken."""
    from inference.worker.core import ModelRuntime

    with worker._pool_lock:
        _check_names_free(worker, config, replacing=None)
        runtime = ModelRuntime(config=config)
        _register(worker, runtime)
    log.info("model %s added to the pool", config.id)
    return {"model": config.id, "action": "added", "placement": _placement(worker, runtime)}


def replace_model(worker: Worker, name: str, config: ModelConfig, drain_secs: float) -> dict[str, Any]:
    """Swap the model `name` for `config` under the same id once the old one has drained."""
    from inference.worker.core import ModelRuntime

    old = worker.resolve(name, enabled_only=False)
    config = config.model_copy(update={"id": old.config.id})
    with worker._pool_lock:
        _check_names_free(worker, config, replacing=old.config.id)
    with _draining(worker, old, drain_secs):
        new = ModelRuntime(config=config)
        with worker._pool_lock:
            _unregister(worker, old)
            _register(worker, new)
    log.info("model %s replaced", config.id)
    return {"model": config.id, "action": "replaced", "placement": _placement(worker, new)}


def update_model(worker: Worker, name: str, config: ModelConfig, drain_secs: float) -> dict[str, Any]:
    """New options for the model `name`: sampling defaults, priority and initial tier apply in
    place; anything else (context, slots) reloads it through a replacement."""
    from models_registry.options import reloads

    runtime = worker.resolve(name, enabled_only=False)
    config = config.model_copy(update={"id": runtime.config.id})
    if reloads(runtime.config, config):
        return {**replace_model(worker, name, config, drain_secs), "action": "reloaded"}
    with worker._pool_lock:
        runtime.config = config
        worker.tiers.set_priority(config.id, config.priority)
    return {"model": config.id, "action": "updated", "placement": _placement(worker, runtime)}


def remove_model(worker: Worker, name: str, drain_secs: float) -> dict[str, Any]:
    """Take the model `name` out of the pool once it has drained; its name then answers 404."""
    old = worker.resolve(name, enabled_only=False)
    with _draining(worker, old, drain_secs):
        with worker._pool_lock:
            _unregister(worker, old)
    log.info("model %s removed from the pool", old.config.id)
    return {"model": old.config.id, "action": "removed"}


class PoolChanging(Exception):
    """The request's model is being replaced or removed; `done` is set when that ends."""

    def __init__(self, done: threading.Event):
        super().__init__("pool change in progress")
        self.done = done


def resubmit_after_change(worker: Worker, done: threading.Event, request: dict[str, Any], sink: Sink) -> None:
    """A request that arrived while its model drains: wait for the change to end, then route it
    again by name (to the new model, or to a 404 when the model was removed)."""
    done.wait()
    worker.submit(request, sink)


class _draining:
    """Hold new requests of `runtime` back, wait until its admitted requests are done and free
    its engine; on timeout let the held requests through to the old model and raise 429. The
    held requests are routed again when the block ends."""

    def __init__(self, worker: Worker, runtime: ModelRuntime, drain_secs: float):
        self.worker, self.runtime, self.drain_secs = worker, runtime, drain_secs

    def __enter__(self) -> None:
        runtime = self.runtime
        with self.worker._lock:
            if runtime.change_done is not None:
                raise ModelBusy(f"The model {runtime.config.id!r} is already being replaced or removed.")
            runtime.change_done = threading.Event()
        deadline = time.monotonic() + self.drain_secs
        while not self._idle():
            if time.monotonic() >= deadline:
                self._finish()
                raise ModelBusy(
                    f"The model {runtime.config.id!r} still serves requests after drain_secs "
                    f"({self.drain_secs:g} s); it stays in service unchanged.")
            time.sleep(DRAIN_POLL_SECS)
        self._unload()

    def __exit__(self, *exc_info: object) -> None:
        self._finish()

    def _idle(self) -> bool:
        with self.worker._lock:
            return self.runtime.admitted == 0

    def _unload(self) -> None:
        runtime, worker = self.runtime, self.worker
        model_id = runtime.config.id
        with runtime.load_lock, worker._placement_lock:
            if runtime.engine is not None:
                worker._demote(model_id, runtime.engine, MemoryTier.TIER3, park=False)
                runtime.engine = None

    def _finish(self) -> None:
        with self.worker._lock:
            done, self.runtime.change_done = self.runtime.change_done, None
        if done is not None:
            done.set()


def _check_names_free(worker: Worker, config: ModelConfig, replacing: str | None) -> None:
    for name in [config.id, *config.aliases]:
        owner = worker.names.get(name)
        if owner is not None and owner != replacing:
            what = "id" if name == config.id else "alias"
            raise InvalidRequest(f"The {what} {name!r} is already taken by the model {owner!r}.", param="model")


def _register(worker: Worker, runtime: ModelRuntime) -> None:
    worker.models[runtime.config.id] = runtime
    for name in [runtime.config.id, *runtime.config.aliases]:
        worker.names[name] = runtime.config.id


def _unregister(worker: Worker, runtime: ModelRuntime) -> None:
    model_id = runtime.config.id
    worker.models.pop(model_id, None)
    for name in [model_id, *runtime.config.aliases]:
        if worker.names.get(name) == model_id:
            del worker.names[name]
    worker.tiers.forget(model_id)


def _placement(worker: Worker, runtime: ModelRuntime) -> dict[str, Any]:
    """Where the model is (tier 3, cold): registering its engine measures its footprint."""
    try:
        with worker._placement_lock:
            worker._engine(runtime)
        return worker.tiers.placement(runtime.config.id).as_dict()
    except Exception as exc:  # the model serves nothing until its files are right; say why
        runtime.problem = str(exc)
        return Placement.on_disk(0).as_dict()
