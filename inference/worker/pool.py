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
from collections.abc import Callable
from typing import Any

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest, ModelBusy
from inference.worker.runtime import ModelRuntime, ModelTable, Sink
from inference.worker.tier_moves import TierMoves
from memory.tiers import MemoryTier, Placement
from models_registry.options import reloads

log = logging.getLogger(__name__)
DRAIN_POLL_SECS = 0.05
POOL_OPS = ("add_model", "replace_model", "remove_model", "update_model")


class PoolChanges:
    """The worker's part that changes the pool: it swaps the table's models, drains them
    through `admission_lock` (the worker's lock on the admission counters) and unloads them
    through the tier moves."""

    def __init__(self, table: ModelTable, moves: TierMoves, admission_lock: threading.Lock):
        self.table = table
        self.moves = moves
        self.admission_lock = admission_lock

    def change(self, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Carry out one pool operation; its result for the route."""
        if op == "add_model":
            return self.add_model(ModelConfig.model_validate(payload["config"]))
        drain_secs = float(payload.get("drain_secs", 120))
        if op == "replace_model":
            return self.replace_model(payload["model"], ModelConfig.model_validate(payload["config"]), drain_secs)
        if op == "update_model":
            return self.update_model(payload["model"], ModelConfig.model_validate(payload["config"]), drain_secs)
        return self.remove_model(payload["model"], drain_secs)

    def add_model(self, config: ModelConfig) -> dict[str, Any]:
        """Put a new model in the pool, cold in tier 3 (its first request loads it); 400 when its
        id or an alias is taken."""
        with self.table.lock:
            self._check_names_free(config, replacing=None)
            runtime = ModelRuntime(config=config)
            self.table.add(runtime)
        log.info("model %s added to the pool", config.id)
        return {"model": config.id, "action": "added", "placement": self._placement(runtime)}

    def replace_model(self, name: str, config: ModelConfig, drain_secs: float) -> dict[str, Any]:
        """Swap the model `name` for `config` under the same id once the old one has drained."""
        old = self.table.resolve(name, enabled_only=False)
        config = config.model_copy(update={"id": old.config.id})
        with self.table.lock:
            self._check_names_free(config, replacing=old.config.id)
        with _draining(self, old, drain_secs):
            new = ModelRuntime(config=config)
            with self.table.lock:
                self._unregister(old)
                self.table.add(new)
        log.info("model %s replaced", config.id)
        return {"model": config.id, "action": "replaced", "placement": self._placement(new)}

    def update_model(self, name: str, config: ModelConfig, drain_secs: float) -> dict[str, Any]:
        """New options for the model `name`: sampling defaults, priority and initial tier apply in
        place; anything else (context, slots) reloads it through a replacement."""
        runtime = self.table.resolve(name, enabled_only=False)
        config = config.model_copy(update={"id": runtime.config.id})
        if reloads(runtime.config, config):
            return {**self.replace_model(name, config, drain_secs), "action": "reloaded"}
        with self.table.lock:
            runtime.config = config
            self.moves.tiers.set_priority(config.id, config.priority)
        return {"model": config.id, "action": "updated", "placement": self._placement(runtime)}

    def remove_model(self, name: str, drain_secs: float) -> dict[str, Any]:
        """Take the model `name` out of the pool once it has drained; its name then answers 404."""
        old = self.table.resolve(name, enabled_only=False)
        with _draining(self, old, drain_secs):
            with self.table.lock:
                self._unregister(old)
        log.info("model %s removed from the pool", old.config.id)
        return {"model": old.config.id, "action": "removed"}

    def _check_names_free(self, config: ModelConfig, replacing: str | None) -> None:
        for name in [config.id, *config.aliases]:
            owner = self.table.owner(name)
            if owner is not None and owner != replacing:
                what = "id" if name == config.id else "alias"
                raise InvalidRequest(f"The {what} {name!r} is already taken by the model {owner!r}.", param="model")

    def _unregister(self, runtime: ModelRuntime) -> None:
        self.table.remove(runtime)
        self.moves.tiers.forget(runtime.config.id)

    def _placement(self, runtime: ModelRuntime) -> dict[str, Any]:
        """Where the model is (tier 3, cold): registering its engine measures its footprint."""
        try:
            with self.moves.placement_lock:
                self.moves.engine(runtime)
            return self.moves.tiers.placement(runtime.config.id).as_dict()
        except Exception as exc:  # the model serves nothing until its files are right; say why
            runtime.problem = str(exc)
            return Placement.on_disk(0).as_dict()


class PoolChanging(Exception):
    """The request's model is being replaced or removed; `done` is set when that ends."""

    def __init__(self, done: threading.Event):
        super().__init__("pool change in progress")
        self.done = done


def resubmit_after_change(submit: Callable[[Any, Sink], None], done: threading.Event, request: Any, sink: Sink) -> None:
    """A request that arrived while its model drains: wait for the change to end, then route it
    again by name with `submit` (to the new model, or to a 404 when the model was removed)."""
    done.wait()
    submit(request, sink)


class _draining:
    """Hold new requests of `runtime` back, wait until its admitted requests are done and free
    its engine; on timeout let the held requests through to the old model and raise 429. The
    held requests are routed again when the block ends."""

    def __init__(self, changes: PoolChanges, runtime: ModelRuntime, drain_secs: float):
        self.changes, self.runtime, self.drain_secs = changes, runtime, drain_secs

    def __enter__(self) -> None:
        runtime = self.runtime
        with self.changes.admission_lock:
            if runtime.change_done is not None:
                raise ModelBusy(f"The model {runtime.config.id!r} is already being replaced or removed.")
            runtime.change_done = threading.Event()
        deadline = time.monotonic() + self.drain_secs
        while not self._idle():
            if time.monotonic() >= deadline:
                self._finish()
                raise ModelBusy(
                    f"The model {runtime.config.id!r} still serves requests after drain_secs "
                    f"({self.drain_secs:g} s); it stays in service unchanged."
                )
            time.sleep(DRAIN_POLL_SECS)
        self._unload()

    def __exit__(self, *exc_info: object) -> None:
        self._finish()

    def _idle(self) -> bool:
        with self.changes.admission_lock:
            return self.runtime.admitted == 0

    def _unload(self) -> None:
        runtime, moves = self.runtime, self.changes.moves
        with runtime.load_lock, moves.placement_lock:
            if runtime.engine is not None:
                moves.demote(runtime.config.id, runtime.engine, MemoryTier.TIER3, park=False)
                runtime.engine = None

    def _finish(self) -> None:
        with self.changes.admission_lock:
            done, self.runtime.change_done = self.runtime.change_done, None
        if done is not None:
            done.set()
