"""What the worker's parts share: a model of the pool at run time, a request's lease on it, and
the table that routes a name to its model.

The worker (core.py) is built from parts that each own one concern (tier moves, pool changes,
status reports, media operations); they all take these types, so none of them imports the
worker itself and the package has no import cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, InsufficientMemory, ModelDisabled, ModelNotFound
from inference.engines.base import Engine
from memory.manager import TierManager

Event = Any  # an inference.transport.wire event
Sink = Callable[[Event], None]
# An eviction of a model whose abandoned request is still in the engine waits this long for the
# engine to reach its next token (or step) and stop.
ENGINE_STOP_SECS = 30.0


@dataclass
class ModelRuntime:
    """One model of the pool: its engine (created on first use) and its admission counters."""

    config: ModelConfig
    engine: Engine | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    slots: threading.BoundedSemaphore = field(init=False)
    admitted: int = 0
    # Interactive requests waiting for a slot now: a background one (a batch's line) waits while
    # there is any.
    interactive_waiting: int = 0
    # Background requests (a batch's lines) holding a slot now: /v1/memory/status says so, so
    # an operator sees which model a batch holds.
    background_running: int = 0
    loads: int = 0
    load_failures: int = 0
    problem: str | None = None
    # Average time a request holds the model (moving average), once measured.
    service_ms: float | None = None
    # Switched by POST /v1/models/{id}/enable|disable; starts as the config says.
    enabled: bool = field(init=False)
    # Set while the model is being replaced or removed: new requests wait for it (worker/pool.py).
    change_done: threading.Event | None = None
    # Requests inside the engine's generation now, abandoned ones included (their lease is
    # already released): the engine is not unloaded or changed until they are out.
    engine_users: int = 0
    engine_idle: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        # Requests that may run at once: the model's execution slots.
        self.slots = threading.BoundedSemaphore(self.config.slots)
        self.enabled = self.config.enabled

    def wait_engine_idle(self, timeout: float = ENGINE_STOP_SECS) -> None:
        """Until no request is inside the engine; 507 when an abandoned one does not stop."""
        with self.engine_idle:
            if not self.engine_idle.wait_for(lambda: self.engine_users == 0, timeout):
                raise InsufficientMemory(
                    f"The model {self.config.id!r} is still stopping an abandoned request; retry shortly."
                )

    def note_service(self, ms: float) -> None:
        self.service_ms = ms if self.service_ms is None else 0.7 * self.service_ms + 0.3 * ms


class Lease:
    """A request's lease on its model. Released once: when the request ends, or at once when
    the request is abandoned while the engine generates (the engine stops at its next token;
    evicting the model meanwhile waits for that: ModelRuntime.wait_engine_idle)."""

    def __init__(self, tiers: TierManager, runtime: ModelRuntime, cancel: threading.Event):
        self.tiers, self.runtime, self.cancel = tiers, runtime, cancel
        self._held = True
        self._generating = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self.tiers.release(self.runtime.config.id)

    def abandon(self) -> None:
        with self._lock:
            early = self._generating
        if early:
            self.release()

    @contextmanager
    def generating(self) -> Iterator[None]:
        """The engine call: counted in the model's engine users; a request cancelled before it
        does not enter (Cancelled)."""
        runtime = self.runtime
        with self._lock:
            if self.cancel.is_set():
                raise Cancelled("the request was cancelled")
            self._generating = True
            with runtime.engine_idle:
                runtime.engine_users += 1
        try:
            yield
        finally:
            with self._lock:
                self._generating = False
            with runtime.engine_idle:
                runtime.engine_users -= 1
                runtime.engine_idle.notify_all()


class ModelTable:
    """The pool's models by id, and every name (id or alias) that routes to one. Pool changes
    (worker/pool.py) swap entries under `lock`; requests read it without."""

    def __init__(self, configs: list[ModelConfig]):
        self.models: dict[str, ModelRuntime] = {}
        self.names: dict[str, str] = {}
        # One pool change (add, replace, remove) at a time updates `models` and `names`.
        self.lock = threading.Lock()
        for config in configs:
            self.add(ModelRuntime(config=config))

    def resolve(self, name: str, enabled_only: bool = True) -> ModelRuntime:
        """The model `name` routes to: 404 model_not_found when none, model_disabled when it is
        disabled and `enabled_only`."""
        model_id = self.names.get(name)
        if model_id is None:
            raise ModelNotFound(f"The model {name!r} does not exist; GET /v1/models lists the models.", param="model")
        runtime = self.models[model_id]
        if enabled_only and not runtime.enabled:
            raise ModelDisabled(f"The model {name!r} is disabled.", param="model")
        return runtime

    def owner(self, name: str) -> str | None:
        """The id of the model `name` routes to, if any."""
        return self.names.get(name)

    def add(self, runtime: ModelRuntime) -> None:
        self.models[runtime.config.id] = runtime
        for name in [runtime.config.id, *runtime.config.aliases]:
            self.names[name] = runtime.config.id

    def remove(self, runtime: ModelRuntime) -> None:
        model_id = runtime.config.id
        self.models.pop(model_id, None)
        for name in [model_id, *runtime.config.aliases]:
            if self.names.get(name) == model_id:
                del self.names[name]
