"""The inference worker: holds the engines, admits requests, moves models between the tiers.

It is transport-agnostic: `submit` takes a typed request (inference/transport/wire.py) and a `sink`
callable that receives the typed events (`Started`, `Delta`, `Done`, `Error`) from any thread. The in-process
transport and `manage.py runinference` both drive this same object. The tier decisions are the
TierManager's (memory/); this module carries them out with the engines.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hypnos_site.config import HypnosConfig
from hypnos_site.errors import (
    STILL_STAGING,
    DeadlineUnmeetable,
    DeviceOutOfMemory,
    HypnosError,
    InsufficientMemory,
    InvalidRequest,
    ModelBusy,
    ModelNotAvailable,
    ServerError,
)
from inference.engines.base import ChatWork, Engine
from inference.transport.wire import (
    ControlRequest,
    Delta,
    DocumentWork,
    Done,
    EngineRequest,
    EntityWork,
    Error,
    GenerateWork,
    ImageWork,
    Queued,
    Reasoning,
    Result,
    Started,
    Usage,
    WorkerAnnouncement,
)
from inference.worker.documents import check_document_model, serve_document
from inference.worker.entities import check_entity_model, serve_entities
from inference.worker.images import check_image_model, serve_images
from inference.worker.media import MEDIA_OPS, MediaWork, media_work, serve_media
from inference.worker.pool import POOL_OPS, PoolChanges, PoolChanging, resubmit_after_change
from inference.worker.runtime import Event, Lease, ModelRuntime, ModelTable, Sink
from inference.worker.status import StatusReports
from inference.worker.tier_moves import TierMoves, TierSwitch
from memory.device import HardwareLimits, probe_device
from memory.kv_park import KvParking
from memory.manager import TierManager
from memory.tiers import MemoryTier, Placement

log = logging.getLogger(__name__)

# How often a request waiting for a slot looks at its cancel flag.
SLOT_POLL_SECS = 0.05
# How often a background request waiting for room that leased models hold looks again.
LEASE_POLL_SECS = 0.1
CONTROL_OPS = (
    "status",
    "memory_status",
    "move",
    "set_limits",
    "kv_park",
    "enable",
    "disable",
    "moe_offload",
    "keep_alive",
    "fault",
)
# `fault` (a real native crash in a running request's thread, for the supervisor's tests)
# exists only when the worker runs with this set to 1.
FAULT_INJECTION_ENV = "HYPNOS_FAULT_INJECTION"
FAULT_DELAY_SECS = 0.25
# glibc's mallopt parameter, and the size from which buffers are mapped on their own (its default
# starting threshold, kept fixed): return_large_buffers.
M_MMAP_THRESHOLD = -3
LARGE_BUFFER_BYTES = 128 << 10


def _changes_placement(op: str, payload: dict[str, Any]) -> bool:
    """Whether a control operation moves models or their memory, which startup staging owns
    until it is done (spec §3: 503 with Retry-After meanwhile). Reading kv_park (no values) is
    not a change."""
    if op == "kv_park":
        return payload.get("enabled") is not None or payload.get("max_bytes") is not None
    return op in ("enable", "disable", "moe_offload")


def hardware_limits(config: HypnosConfig) -> HardwareLimits:
    return HardwareLimits.of(config.hardware)


def return_large_buffers() -> None:
    """Give every large buffer back to the system when it is freed (glibc: a fixed mmap
    threshold of LARGE_BUFFER_BYTES). glibc's own threshold rises after each large free, up to
    32 MiB, so the activations of one request (the OCR's detector, ~150 MB; a decoded page) stay
    in some thread's heap afterwards, and the next request on another of the 64 engine threads
    grows the process again: measured, a 14,400 pt page grew the test process 427 MiB after
    another module's requests against 129 MiB with the threshold fixed. The cost is a page fault
    per 4 KiB of each such buffer, milliseconds per request. Not glibc: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES)
    except (OSError, AttributeError):
        pass


class Worker:
    """Admission, leases and the request path for the configured models; built from the parts
    it owns: the model table (runtime.py), the tier moves (tier_moves.py), the pool changes
    (pool.py) and the status reports (status.py)."""

    def __init__(self, config: HypnosConfig):
        self.config = config
        self.device = probe_device(hardware_limits(config))
        self.tiers = TierManager(self.device, hardware_limits(config))
        self.tiers.set_max_resident(config.hardware.max_resident_models)
        self.kv_parking = KvParking(
            config.hardware.kv_park, config.hardware.kv_park_max_bytes, config.server.kv_idle_timeout_secs
        )
        self.table = ModelTable(config.models)
        # The admission counters (ModelRuntime.admitted, change_done).
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.moves = TierMoves(config, self.tiers, self.kv_parking, self.table, self._stopping)
        self.pool_changes = PoolChanges(self.table, self.moves, self._lock)
        self.reports = StatusReports(
            config,
            self.device,
            self.tiers,
            self.kv_parking,
            self.table,
            self.moves,
            lambda: self.ready,
            self.estimated_wait_ms,
        )
        self._cancels: dict[str, threading.Event] = {}
        self._leases: dict[str, Lease] = {}
        # Request ids armed by the `fault` control op (FAULT_INJECTION_ENV), each with the
        # monotonic time from which it faults and how (crash, hang).
        self._faults: dict[str, tuple[float, str]] = {}
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="hypnos-infer")
        self._staged = threading.Event()
        self.started_at = time.time()

    @property
    def models(self) -> dict[str, ModelRuntime]:
        """The pool's models by id."""
        return self.table.models

    @property
    def evictions_total(self) -> int:
        return self.moves.evictions_total

    def status(self) -> dict[str, Any]:
        """What the web process shows in /ready and /v1/models."""
        return self.reports.status()

    def memory_status(self) -> dict[str, Any]:
        """GET /v1/memory/status (spec §14), all but the web process's own latency figures."""
        return self.reports.memory_status()

    @property
    def worker_id(self) -> str:
        return self.reports.worker_id

    def announcement(self, channel: str, draining: bool = False) -> WorkerAnnouncement:
        """What the channel server announces of this worker (inference/transport/cluster.py)."""
        return self.reports.announcement(channel, draining)

    def move(self, name: str, target: MemoryTier, context_len: int | None) -> Placement:
        """POST /v1/memory/tier and startup staging: put an idle model in `target`."""
        return self.moves.move(name, target, context_len)

    def set_moe_offload(self, name: str, mode: str) -> dict[str, Any]:
        """POST /v1/models/{id}/moe-offload (spec §6)."""
        return self.moves.set_moe_offload(name, mode)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Stage the startup models in the background; the caller's port can open meanwhile."""
        return_large_buffers()
        threading.Thread(target=self._stage, name="hypnos-staging", daemon=True).start()
        threading.Thread(target=self.moves.unload_idle, name="hypnos-idle-unload", daemon=True).start()
        if self.config.server.kv_idle_timeout_secs is not None:
            threading.Thread(
                target=self.moves.empty_idle_slots,
                args=(self.config.server.kv_idle_timeout_secs,),
                name="hypnos-kv-idle",
                daemon=True,
            ).start()

    @property
    def ready(self) -> bool:
        return self._staged.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._staged.wait(timeout)

    def shutdown(self) -> None:
        self._stopping.set()
        for cancel in list(self._cancels.values()):
            cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._keeps_parked_states:
            self.moves.park_resident()
            try:
                saved = self.kv_parking.save(self.parked_states_dir)
                log.info("parked the KV state of %d model(s) in %s", saved, self.parked_states_dir)
            except OSError as exc:
                log.error("could not keep the parked KV states in %s: %s", self.parked_states_dir, exc)
        # cool, not unload: the warm copies (memfds) go too, so a worker that is shut down while
        # its process goes on (the tests, a runtime.serving swap) leaves no tier-2 memory behind.
        for runtime in self.models.values():
            if runtime.engine is not None:
                runtime.engine.cool()

    @property
    def parked_states_dir(self) -> Path:
        """Where a stopping worker keeps its parked KV states for the next one."""
        return self.config.data_dir / "kv-park" / self.worker_id

    @property
    def _keeps_parked_states(self) -> bool:
        return self.kv_parking.enabled and self.config.hardware.kv_park_across_restarts

    def _stage(self) -> None:
        """Bring each enabled model to its `initial_tier` (spec §3), tier 1 first, after taking
        back the KV states the previous worker parked (a model staged in tier 1 restores them)."""
        try:
            if self._keeps_parked_states:
                taken = self.kv_parking.load(self.parked_states_dir)
                if taken:
                    log.info("took back the parked KV state of %d model(s)", taken)
            for runtime in self.models.values():
                try:
                    with self.moves.placement_lock:
                        self.moves.engine(runtime)  # registers the footprint, so status shows every model
                except HypnosError as exc:
                    runtime.problem = exc.message
            order = sorted(self.models.values(), key=lambda r: r.config.initial_tier)
            for runtime in order:
                pinned_elsewhere = runtime.config.workers and self.worker_id not in runtime.config.workers
                if (
                    not runtime.config.enabled
                    or runtime.config.initial_tier == MemoryTier.TIER3.value
                    or pinned_elsewhere
                ):
                    continue
                try:
                    self.move(runtime.config.id, MemoryTier(runtime.config.initial_tier), None)
                except HypnosError as exc:
                    # A model that cannot stage must not keep the others from serving.
                    runtime.problem = exc.message
                    log.error("staging %s failed: %s", runtime.config.id, exc.message)
        finally:
            self._staged.set()
            log.info("startup staging done")

    # -- requests ----------------------------------------------------------------------------

    def resolve(self, name: str, enabled_only: bool = True) -> ModelRuntime:
        """The model `name` routes to (404 when none, or disabled and `enabled_only`)."""
        return self.table.resolve(name, enabled_only)

    def set_enabled(self, name: str, enabled: bool) -> ModelRuntime:
        """POST /v1/models/{id}/enable|disable: a disabled model is evicted to disk and refused
        (404 model_disabled) until enabled again; 429 while it serves a request."""
        runtime = self.resolve(name, enabled_only=False)
        model_id = runtime.config.id
        with runtime.load_lock, self.moves.placement_lock:
            if not enabled and self.tiers.leases(model_id):
                raise ModelBusy(f"The model {model_id!r} is serving requests; retry when it is idle.")
            if not enabled:
                runtime.wait_engine_idle()
            runtime.enabled = enabled
            if not enabled and runtime.engine is not None and model_id in self.tiers:
                self.moves.demote(model_id, runtime.engine, MemoryTier.TIER3, park=False)
        return runtime

    def submit(self, request: EngineRequest | ControlRequest, sink: Sink) -> None:
        """Admit a request or refuse it at once; an admitted one runs on a worker thread.
        Control operations (status, memory_status, move) answer with one `Result` event."""
        if isinstance(request, ControlRequest):
            self._executor.submit(self._control, request.op, request.args, sink)
            return
        try:
            if not self.ready:
                raise ModelNotAvailable(STILL_STAGING)
            runtime = self.resolve(request.model)
            self._check_pinned(runtime)
            work: ChatWork | MediaWork | DocumentWork | EntityWork | ImageWork
            if request.work.kind in MEDIA_OPS:
                work = media_work(runtime.config, request.work)  # type: ignore[arg-type]
            elif isinstance(request.work, DocumentWork):
                check_document_model(runtime.config)
                work = request.work
            elif isinstance(request.work, EntityWork):
                check_entity_model(runtime.config)
                work = request.work
            elif isinstance(request.work, ImageWork):
                check_image_model(runtime.config)
                work = request.work
            else:
                if not isinstance(request.work, GenerateWork) or runtime.config.modality not in (
                    "text_generation",
                    "vision",
                ):
                    raise InvalidRequest(
                        f"The model {runtime.config.id!r} serves {runtime.config.modality}, not chat completions.",
                        param="model",
                    )
                work = ChatWork.of(request.work)
                if request.background:
                    work = work.model_copy(update={"background": True})
                self._check_capabilities(runtime, work)
            estimate = self._admit(runtime, request.deadline_ms or self._implicit_deadline_ms())
        except PoolChanging as changing:
            self._executor.submit(resubmit_after_change, self.submit, changing.done, request, sink)
            return
        except HypnosError as exc:
            sink(Error.of(exc))
            return
        sink(Queued(estimated_wait_ms=estimate))
        if os.environ.get(FAULT_INJECTION_ENV) == "1":
            sink = self._faulty(request.request_id, sink)
        cancel = threading.Event()
        self._cancels[request.request_id] = cancel
        self._executor.submit(self._run, runtime, request.request_id, work, cancel, sink, request.background)
        if request.next_model:
            self._executor.submit(self._prefetch, request.next_model)

    def _check_pinned(self, runtime: ModelRuntime) -> None:
        """A model whose block pins it to other workers (`workers = [...]`) is not loaded here."""
        pins = runtime.config.workers
        if pins and self.worker_id not in pins:
            raise ModelNotAvailable(
                f"The model {runtime.config.id!r} is served by the workers {', '.join(pins)}, not by {self.worker_id}."
            )

    def _prefetch(self, name: str) -> None:
        """x-hypnos-next-model: bring the model the client will call next to tier 1 meanwhile.
        Unknown, busy or unplaceable models are left alone; the header never changes a response."""
        try:
            runtime = self.resolve(name)
            self._check_pinned(runtime)
            if runtime.engine is None or not runtime.engine.loaded:
                self.move(name, MemoryTier.TIER1, None)
        except HypnosError as exc:
            log.info("prefetch of %s skipped: %s", name, exc.message)

    def _faulty(self, request_id: str, sink: Sink) -> Sink:
        """The request's sink, which, in the thread that emits the request's first event
        FAULT_DELAY_SECS after `fault` armed it (the engine's thread, mid-generation), crashes
        the process natively (SIGSEGV) or hangs in a native call that never returns."""

        def emit(event: Event) -> None:
            armed = self._faults.get(request_id)
            if armed is not None and time.monotonic() >= armed[0]:
                if armed[1] == "hang":
                    log.error("request %s: fault injection, hanging in a native call", request_id)
                    libc = ctypes.CDLL(None)
                    while True:  # sleep(3) returns early on a signal: sleep again
                        libc.sleep(3600)
                log.error("request %s: fault injection, reading address 0", request_id)
                ctypes.string_at(0)
            sink(event)

        return emit

    def _arm_fault(self, payload: dict[str, Any]) -> dict[str, Any]:
        if os.environ.get(FAULT_INJECTION_ENV) != "1":
            raise InvalidRequest(f"fault injection is off ({FAULT_INJECTION_ENV} is not 1 on the worker)")
        # A crash waits FAULT_DELAY_SECS so that the arming's own answer reaches the caller first:
        # a crash on the very next token could beat it out of the process. A hang stops only the
        # engine's thread, so it takes the very next event (a short answer may have no later one).
        fault = payload.get("fault", "crash")
        delay = FAULT_DELAY_SECS if fault == "crash" else 0.0
        self._faults[payload["request_id"]] = (time.monotonic() + delay, fault)
        return {"armed": payload["request_id"]}

    def _control(self, op: str, payload: dict[str, Any], sink: Sink) -> None:
        try:
            if op == "fault":
                result: Any = self._arm_fault(payload)
            elif op == "status":
                result = self.status()
            elif op == "memory_status":
                result = self.memory_status()
            elif not self.ready and _changes_placement(op, payload):
                raise ModelNotAvailable(STILL_STAGING)
            elif op in ("enable", "disable"):
                runtime = self.set_enabled(payload["model"], op == "enable")
                placement = self.tiers.placement(runtime.config.id)
                result = {"model": runtime.config.id, "enabled": runtime.enabled, "placement": placement.as_dict()}
            elif op == "moe_offload":
                result = self.set_moe_offload(payload["model"], payload["mode"])
            elif op == "keep_alive":
                secs = self.moves.set_keep_alive(payload["model"], payload["secs"])
                result = {"model": self.resolve(payload["model"]).config.id, "keep_alive_secs": secs}
            elif op == "kv_park":
                self.kv_parking.configure(payload.get("enabled"), payload.get("max_bytes"))
                result = self.kv_parking.status()
            elif op in POOL_OPS:
                if not self.ready:
                    raise ModelNotAvailable(STILL_STAGING)
                result = self.pool_changes.change(op, payload)
            elif op == "set_limits":
                self.tiers.set_max_resident(payload.get("max_loaded_models"))
                result = {"max_loaded_models": self.tiers.max_resident}
            else:
                if not self.ready:
                    raise ModelNotAvailable(STILL_STAGING)
                if payload["target_tier"] != MemoryTier.TIER3.value:
                    self._check_pinned(self.resolve(payload["model"], enabled_only=False))
                placement = self.move(payload["model"], MemoryTier(payload["target_tier"]), payload.get("context_len"))
                result = {"model": self.resolve(payload["model"]).config.id, "placement": placement.as_dict()}
            sink(Result(result=result))
        except HypnosError as exc:
            sink(Error.of(exc))
        except Exception as exc:
            log.exception("control operation %s failed", op)
            sink(Error.of(ServerError(f"{op} failed: {type(exc).__name__}: {exc}")))

    def _check_capabilities(self, runtime: ModelRuntime, work: ChatWork) -> None:
        engine = runtime.engine
        if engine is None:
            return
        if work.images and "vision" not in engine.capabilities():
            raise InvalidRequest(
                f"The model {runtime.config.id!r} does not serve vision, so it cannot take image_url parts.",
                param="messages",
            )
        if not work.tools or work.tool_choice == "none":
            return
        if "tools" not in engine.capabilities():
            raise InvalidRequest(
                f"The model {runtime.config.id!r} has no tool-calling format; send no tools or use another model.",
                param="tools",
            )

    def abort(self, request_id: str) -> None:
        """Stop a request (its client left): the engine stops at its next token, and a lease
        held while it generates is released now, so a request behind it finds the room free."""
        cancel = self._cancels.get(request_id)
        if cancel is not None:
            cancel.set()
        lease = self._leases.get(request_id)
        if lease is not None:
            lease.abandon()

    def _admit(self, runtime: ModelRuntime, deadline_ms: float | None) -> float | None:
        """Count the request in, or refuse it (429 queue full, 503 deadline unmeetable); the
        estimated wait before it starts, when one can be made. PoolChanging while the model is
        being replaced or removed: the request is not counted and waits for the change."""
        with self._lock:
            if runtime.change_done is not None:
                raise PoolChanging(runtime.change_done)
            if runtime.admitted >= self.config.limits.max_queue_per_model:
                raise ModelBusy(
                    f"The model {runtime.config.id!r} already has {runtime.admitted} requests queued or running "
                    f"(limits.max_queue_per_model = {self.config.limits.max_queue_per_model}).",
                )
            estimate = self.estimated_wait_ms(runtime)
            if deadline_ms is not None and estimate is not None and estimate > deadline_ms:
                error = DeadlineUnmeetable(
                    f"The request would wait about {estimate:.0f} ms before it starts, beyond its "
                    f"x-hypnos-deadline-ms of {deadline_ms:g}."
                )
                error.headers = {"Retry-After": str(max(1, math.ceil(estimate / 1000)))}
                raise error
            runtime.admitted += 1
            return estimate

    def _implicit_deadline_ms(self) -> float | None:
        """With limits.overload = "shed", the profile's objective bounds every request's wait."""
        profile = self.config.server.profile
        if self.config.limits.overload != "shed" or profile is None:
            return None
        return profile.objective.target_ms

    def estimated_wait_ms(self, runtime: ModelRuntime) -> float | None:
        """Requests ahead beyond the model's slots times its average service time, plus a load
        when it is not in tier 1 (spec §1). None while the model is busy but has no history."""
        slots = max(runtime.config.slots if runtime.engine is None else runtime.engine.max_concurrency, 1)
        ahead = max(runtime.admitted - slots + 1, 0)
        if ahead and runtime.service_ms is None:
            return None
        wait = ahead * (runtime.service_ms or 0.0) / slots
        wait += self.tiers.reload_estimate_ms(runtime.config.id) or 0.0
        return round(wait, 1)

    def _take_slot(self, runtime: ModelRuntime, cancel: threading.Event, background: bool) -> bool:
        """Wait for one of the model's slots (False: the request was cancelled meanwhile). An
        interactive request is counted as waiting until it has one; a background one (a batch's
        line) does not try while any interactive request waits, so it never takes the slot that
        one is waiting for."""
        if background:
            # Never blocked inside the semaphore: a slot released goes to a request blocked there.
            while not cancel.is_set():
                if runtime.interactive_waiting == 0 and runtime.slots.acquire(blocking=False):
                    return True
                cancel.wait(SLOT_POLL_SECS)
            return False
        with self._lock:
            runtime.interactive_waiting += 1
        try:
            while not runtime.slots.acquire(timeout=SLOT_POLL_SECS):
                if cancel.is_set():
                    return False
            return True
        finally:
            with self._lock:
                runtime.interactive_waiting -= 1

    def _run(
        self,
        runtime: ModelRuntime,
        request_id: str,
        work: ChatWork | MediaWork | DocumentWork | EntityWork | ImageWork,
        cancel: threading.Event,
        sink: Sink,
        background: bool = False,
    ) -> None:
        arrived = time.perf_counter()
        holding_slot = False
        lease: Lease | None = None
        final: Event | None = None
        try:
            if not self._take_slot(runtime, cancel, background):
                return
            holding_slot = True
            if background:
                with self._lock:
                    runtime.background_running += 1
            with self.moves.placement_lock:
                engine = self.moves.engine(runtime)
                self.tiers.lease(runtime.config.id)
                lease = self._leases[request_id] = Lease(self.tiers, runtime, cancel)
            while True:
                queue_ms = (time.perf_counter() - arrived) * 1000
                try:
                    final = self._serve(runtime, engine, work, lease, sink, queue_ms)
                    break
                except InsufficientMemory:
                    # Refused before it sent anything (ensure_tier1 comes first on every path).
                    if not background or not self._wait_for_leased_room(runtime, cancel):
                        raise
            runtime.note_service((time.perf_counter() - arrived) * 1000 - queue_ms)
        except HypnosError as exc:
            final = Error.of(exc)
        except Exception as exc:
            log.exception("request %s on %s failed", request_id, runtime.config.id)
            final = Error.of(ServerError(f"The engine failed: {type(exc).__name__}: {exc}"))
        finally:
            # Everything is released before the client hears the end, so its next request
            # never finds this one's lease or slot still held.
            if lease is not None:
                lease.release()
            if holding_slot:
                if background:
                    with self._lock:
                        runtime.background_running -= 1
                runtime.slots.release()
            with self._lock:
                runtime.admitted -= 1
            self._cancels.pop(request_id, None)
            self._leases.pop(request_id, None)
            self._faults.pop(request_id, None)
            if final is not None:
                sink(final)

    def _serve(
        self,
        runtime: ModelRuntime,
        engine: Engine,
        work: ChatWork | MediaWork | DocumentWork | EntityWork | ImageWork,
        lease: Lease,
        sink: Sink,
        queue_ms: float,
    ) -> Event:
        """Run the (leased) request on its engine, streaming into `sink`; its terminal event."""
        if isinstance(work, MediaWork):
            return serve_media(self.moves, runtime, engine, work, lease.cancel, sink, queue_ms)
        if isinstance(work, DocumentWork):
            return serve_document(self.moves, runtime, engine, work, lease.cancel, sink, queue_ms)  # type: ignore[arg-type]
        if isinstance(work, EntityWork):
            return serve_entities(self.moves, runtime, engine, work, lease, sink, queue_ms, self.config.limits)
        if isinstance(work, ImageWork):
            return serve_images(self.moves, runtime, engine, work, lease, sink, queue_ms)
        return self._serve_chat(runtime, engine, work, lease, sink, queue_ms)

    def _wait_for_leased_room(self, runtime: ModelRuntime, cancel: threading.Event) -> bool:
        """A background request (a batch's line) refused tier-1 room that models leased by other
        requests hold: it waits, holding its own slot, until they let go, so it never fails
        because interactive traffic was using the room, and never takes that room from it (a
        leased model is never evicted). True: try again; False: the refusal stands (nothing
        leased is in the way, or the request was cancelled meanwhile)."""
        model_id, context_len = runtime.config.id, runtime.config.context_len
        leased = self.tiers.held_by_leases(model_id, context_len)
        if not leased:
            return False
        log.info("%s (background) waits for the room that leased %s hold", model_id, ", ".join(leased))
        while self.tiers.held_by_leases(model_id, context_len):
            if cancel.wait(LEASE_POLL_SECS):
                return False
        return True

    def _serve_chat(
        self, runtime: ModelRuntime, engine: Engine, work: ChatWork, lease: Lease, sink: Sink, queue_ms: float
    ) -> Event:
        """Run the chat, streaming deltas into `sink`; the terminal `done` event is returned."""
        cancel = lease.cancel
        work, switch = self.moves.prepare_chat(runtime, engine, work, self.config.limits)
        tokens = work.prepared.tokens if work.prepared is not None else None
        sink(Started(previous_tier=str(switch.previous_tier), prompt_tokens=len(tokens) if tokens else None))
        if work.count_only:
            return self._counted(runtime, engine, work, switch, queue_ms)
        sent = False

        def on_delta(text: str, logprobs: list[dict[str, Any]] | None, reasoning: bool = False, /) -> None:
            nonlocal sent
            sent = True
            sink(Reasoning(text=text) if reasoning else Delta(text=text, logprobs=logprobs))

        started = time.perf_counter()
        try:
            with lease.generating():
                result = engine.chat(work, cancel, on_delta)
        except DeviceOutOfMemory:
            if sent:
                raise
            # Spec §4: evict the idle models and retry once.
            switch.evicted += self.moves.evict_idle(runtime.config.id, "device_out_of_memory")
            with lease.generating():
                result = engine.chat(work, cancel, on_delta)
        inference_ms = (time.perf_counter() - started) * 1000
        placement = self.tiers.placement(runtime.config.id)
        telemetry = switch.telemetry(
            placement, inference_ms, {"queue_ms": round(queue_ms, 1), **result.engine_timings()}
        )
        if switch.phases:
            telemetry["tier_switch_phases"] = switch.phases.as_dict()
        usage = Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_tokens=result.cached_tokens,
        )
        return Done(
            finish_reason=result.finish_reason,
            tool_calls=result.tool_calls,
            usage=usage,
            telemetry=telemetry,
            stop_sequence=result.stop_sequence if result.finish_reason == "stop" else None,
        )

    def _counted(
        self, runtime: ModelRuntime, engine: Engine, work: ChatWork, switch: TierSwitch, queue_ms: float
    ) -> Event:
        """A count_only chat (issue 17, POST /v1/messages/count_tokens): its prompt tokens as its
        generation would report them, nothing evaluated; finish_reason "counted"."""
        started = time.perf_counter()
        count = engine.count_prompt(work)
        placement = self.tiers.placement(runtime.config.id)
        telemetry = switch.telemetry(
            placement, (time.perf_counter() - started) * 1000, {"queue_ms": round(queue_ms, 1)}
        )
        return Done(finish_reason="counted", usage=Usage(prompt_tokens=count), telemetry=telemetry)
