"""The inference worker: holds the engines, admits requests, runs them on threads.

It is transport-agnostic: `submit` takes a plain-dict request and a `sink` callable that
receives plain-dict events (`started`, `delta`, `done`, `error`) from any thread. The in-process
transport and `manage.py runinference` both drive this same object.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hypnos_site.config import HypnosConfig, ModelConfig
from inference.engines.base import ChatWork, Engine, LoadPhases, engine_class
from inference.errors import (
    STILL_STAGING,
    HypnosError,
    InvalidRequest,
    ModelBusy,
    ModelDisabled,
    ModelNotAvailable,
    ModelNotFound,
    ServerError,
)
from memory.tiers import MemoryTier, Placement

log = logging.getLogger(__name__)

Event = dict[str, Any]
Sink = Callable[[Event], None]
# How often a request waiting for a slot looks at its cancel flag.
SLOT_POLL_SECS = 0.05


@dataclass
class ModelRuntime:
    """One model of the pool and what the worker knows about it."""

    config: ModelConfig
    engine: Engine | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    slots: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(1))
    admitted: int = 0
    active_leases: int = 0
    requests_served: int = 0
    last_used: float = field(default_factory=time.monotonic)
    load_error: str | None = None

    def placement(self) -> Placement:
        if self.engine is None:
            return Placement.on_disk(0)
        return self.engine.placement()

    @property
    def current_tier(self) -> MemoryTier:
        return self.placement().primary_tier


class Worker:
    """Admission, leases and single-flight loads for the configured models."""

    def __init__(self, config: HypnosConfig):
        self.config = config
        self.models: dict[str, ModelRuntime] = {}
        self.names: dict[str, str] = {}
        for model in config.models:
            self.models[model.id] = ModelRuntime(config=model)
            for name in [model.id, *model.aliases]:
                self.names[name] = model.id
        self._lock = threading.Lock()
        self._cancels: dict[str, threading.Event] = {}
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="hypnos-infer")
        self._staged = threading.Event()
        self.staging_error: str | None = None
        self.started_at = time.time()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Stage the startup models in the background; the caller's port can open meanwhile."""
        threading.Thread(target=self._stage, name="hypnos-staging", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self._staged.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._staged.wait(timeout)

    def shutdown(self) -> None:
        for cancel in list(self._cancels.values()):
            cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        for runtime in self.models.values():
            if runtime.engine is not None:
                runtime.engine.unload()

    def _stage(self) -> None:
        try:
            for runtime in self.models.values():
                if runtime.config.enabled and runtime.config.initial_tier == MemoryTier.TIER1:
                    try:
                        self._ensure_loaded(runtime, runtime.config.context_len)
                    except HypnosError as exc:
                        # A model that cannot load must not keep the others from serving.
                        runtime.load_error = exc.message
                        log.error("staging %s failed: %s", runtime.config.id, exc.message)
        finally:
            self._staged.set()
            log.info("startup staging done")

    # -- requests ----------------------------------------------------------------------------

    def resolve(self, name: str) -> ModelRuntime:
        model_id = self.names.get(name)
        if model_id is None:
            raise ModelNotFound(f"The model {name!r} does not exist; GET /v1/models lists the models.", param="model")
        runtime = self.models[model_id]
        if not runtime.config.enabled:
            raise ModelDisabled(f"The model {name!r} is disabled.", param="model")
        return runtime

    def submit(self, request: dict[str, Any], sink: Sink) -> None:
        """Admit a request or refuse it at once; an admitted one runs on a worker thread."""
        try:
            if not self.ready:
                raise ModelNotAvailable(STILL_STAGING)
            runtime = self.resolve(request["model"])
            if request["op"] != "chat" or runtime.config.modality != "text_generation":
                raise InvalidRequest(
                    f"The model {runtime.config.id!r} serves {runtime.config.modality}, not chat completions.",
                    param="model",
                )
            work = ChatWork(**request["payload"])
            self._admit(runtime)
        except HypnosError as exc:
            sink(exc.as_event())
            return
        except (KeyError, TypeError) as exc:
            sink(InvalidRequest(f"malformed worker request: {exc}").as_event())
            return
        cancel = threading.Event()
        self._cancels[request["request_id"]] = cancel
        self._executor.submit(self._run, runtime, request["request_id"], work, cancel, sink)

    def abort(self, request_id: str) -> None:
        cancel = self._cancels.get(request_id)
        if cancel is not None:
            cancel.set()

    def _admit(self, runtime: ModelRuntime) -> None:
        with self._lock:
            if runtime.admitted >= self.config.limits.max_queue_per_model:
                raise ModelBusy(
                    f"The model {runtime.config.id!r} already has {runtime.admitted} requests queued or running "
                    f"(limits.max_queue_per_model = {self.config.limits.max_queue_per_model}).",
                )
            runtime.admitted += 1

    def _run(self, runtime: ModelRuntime, request_id: str, work: ChatWork, cancel: threading.Event, sink: Sink) -> None:
        arrived = time.perf_counter()
        holding_slot = False
        try:
            while not runtime.slots.acquire(timeout=SLOT_POLL_SECS):
                if cancel.is_set():
                    return
            holding_slot = True
            with self._lease(runtime):
                self._serve_chat(runtime, work, cancel, sink, queue_ms=(time.perf_counter() - arrived) * 1000)
        except HypnosError as exc:
            sink(exc.as_event())
        except Exception as exc:
            log.exception("request %s on %s failed", request_id, runtime.config.id)
            sink(ServerError(f"The engine failed: {type(exc).__name__}: {exc}").as_event())
        finally:
            if holding_slot:
                runtime.slots.release()
            with self._lock:
                runtime.admitted -= 1
            self._cancels.pop(request_id, None)

    def _serve_chat(self, runtime: ModelRuntime, work: ChatWork, cancel: threading.Event, sink: Sink, queue_ms: float) -> None:
        previous_tier = runtime.current_tier
        needed_ctx = max(runtime.config.context_len, work.num_ctx or 0)
        phases = self._ensure_loaded(runtime, needed_ctx)
        engine = runtime.engine
        assert engine is not None
        switch_ms = phases.total_ms if phases else 0.0
        sink({"kind": "started", "previous_tier": str(previous_tier)})
        started = time.perf_counter()
        result = engine.chat(work, cancel, lambda text: sink({"kind": "delta", "text": text}))
        inference_ms = (time.perf_counter() - started) * 1000
        runtime.requests_served += 1
        telemetry: dict[str, Any] = {
            "previous_tier": str(previous_tier),
            "placement": engine.placement().as_dict(),
            "tier_switch_latency_ms": round(switch_ms, 1),
            "inference_latency_ms": round(inference_ms, 1),
            "evicted_models": [],
            "engine": {"queue_ms": round(queue_ms, 1), **result.engine_timings()},
        }
        if phases:
            telemetry["tier_switch_phases"] = phases.as_dict()
        sink(
            {
                "kind": "done",
                "finish_reason": result.finish_reason,
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "total_tokens": result.prompt_tokens + result.completion_tokens,
                    "cached_tokens": result.cached_tokens,
                },
                "telemetry": telemetry,
            }
        )

    def _lease(self, runtime: ModelRuntime) -> _Lease:
        return _Lease(self, runtime)

    def _ensure_loaded(self, runtime: ModelRuntime, context_len: int) -> LoadPhases | None:
        """Load the model (single-flight) so that it funds `context_len` tokens, up to what the
        model was trained for. The phases of the load this call did, or None on the fast path."""
        with runtime.load_lock:
            engine = runtime.engine or self._new_engine(runtime)
            runtime.engine = engine
            phases = None
            if not engine.loaded:
                phases = engine.load(runtime.config.context_len)
            wanted = min(context_len, engine.trained_context_len or context_len)
            if engine.context_len < wanted:
                # A larger context than the current one: rebuild it (spec §7.1 num_ctx).
                engine.unload()
                rebuild = engine.load(wanted)
                phases = rebuild if phases is None else phases.plus(rebuild)
            runtime.load_error = None
            return phases

    def _new_engine(self, runtime: ModelRuntime) -> Engine:
        try:
            cls = engine_class(runtime.config.engine)
        except NotImplementedError as exc:
            raise ModelNotAvailable(str(exc)) from exc
        weights = self.config.weights_file(runtime.config)
        if not weights.exists():
            raise ModelNotAvailable(
                f"The model {runtime.config.id!r} cannot be served: its weights {weights} are missing "
                "(./run.sh installs the default models)."
            )
        return cls(runtime.config, weights, self.config.hardware.n_threads)

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What the web process shows in /ready and /v1/models."""
        return {
            "ready": self.ready,
            "models": {
                model_id: {
                    "current_tier": str(runtime.current_tier),
                    "placement": runtime.placement().as_dict(),
                    "active_leases": runtime.active_leases,
                    "requests_served": runtime.requests_served,
                    "load_error": runtime.load_error,
                }
                for model_id, runtime in self.models.items()
            },
        }


class _Lease:
    """A model serving a request is leased: never evicted or moved meanwhile."""

    def __init__(self, worker: Worker, runtime: ModelRuntime):
        self.worker, self.runtime = worker, runtime

    def __enter__(self) -> ModelRuntime:
        with self.worker._lock:
            self.runtime.active_leases += 1
        return self.runtime

    def __exit__(self, *exc: object) -> None:
        with self.worker._lock:
            self.runtime.active_leases -= 1
            self.runtime.last_used = time.monotonic()
