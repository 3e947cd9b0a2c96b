"""The worker's tier moves: creating engines, promoting a model to tier 1 (single-flight),
demoting and evicting idle ones, warming, moving by hand, MoE offload changes and emptying idle
KV slots. The decisions are the TierManager's (memory/); this part of the worker carries them out
with the engines, under its placement lock."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hypnos_site.config import HypnosConfig, LimitsConfig, ModelConfig
from hypnos_site.errors import (
    InsufficientMemory,
    InvalidRequest,
    ModelBusy,
    ModelNotAvailable,
    ProcessMemoryCap,
    UnprocessableEntity,
)
from inference.engines.base import ChatWork, Engine, LoadPhases, engine_class
from inference.worker.runtime import ModelRuntime, ModelTable
from memory.kv_park import KvParking
from memory.manager import Eviction, NoRoom, TierManager
from memory.planner import MOE_OFFLOAD_MODES
from memory.tiers import MemoryTier, Placement

log = logging.getLogger(__name__)
MIN_CONTEXT = 2048
# server.keep_alive_secs = "auto" on a GPU (Ollama's default), and how often idle unload looks.
AUTO_KEEP_ALIVE_SECS = 300.0
IDLE_CHECK_SECS = 1.0
# The context estimate's budget for one image (spec §7.1).
IMAGE_CONTEXT_TOKENS = 576
NO_ROOM_ERRORS = {"insufficient_vram_or_ram": InsufficientMemory, "process_memory_cap": ProcessMemoryCap}


@dataclass
class TierSwitch:
    """What bringing a model to tier 1 cost this request."""

    previous_tier: MemoryTier
    phases: LoadPhases | None = None
    evicted: list[str] = field(default_factory=list)

    @property
    def switch_ms(self) -> float:
        return round(self.phases.total_ms, 1) if self.phases else 0.0

    def absorb(self, later: TierSwitch) -> None:
        """Count a later switch of the same request (a context grown for its prompt) in this one."""
        if later.phases is not None:
            self.phases = later.phases if self.phases is None else self.phases.plus(later.phases)
        self.evicted += later.evicted

    def telemetry(self, placement: Placement, inference_ms: float, engine: dict[str, Any]) -> dict[str, Any]:
        """hypnos_telemetry (spec §5) of a request this switch served; `engine` its timings."""
        return {
            "previous_tier": str(self.previous_tier),
            "placement": placement.as_dict(),
            "tier_switch_latency_ms": self.switch_ms,
            "inference_latency_ms": round(inference_ms, 1),
            "evicted_models": self.evicted,
            "engine": engine,
        }


def needed_context(work: ChatWork) -> int:
    """The request's num_ctx, else an estimate from the prompt and max_tokens with a floor of
    2048 (spec §7.1); about three characters make a token."""
    if work.num_ctx:
        return work.num_ctx
    chars = sum(len(str(m.get("content") or "")) for m in work.messages) + len(work.raw_prompt or "")
    return max(MIN_CONTEXT, chars // 3 + IMAGE_CONTEXT_TOKENS * len(work.images) + work.max_tokens)


class TierMoves:
    """The worker's part that moves models between the tiers (its engines, loads, evictions)."""

    def __init__(
        self,
        config: HypnosConfig,
        tiers: TierManager,
        kv_parking: KvParking,
        table: ModelTable,
        stopping: threading.Event,
    ):
        self.config = config
        self.tiers = tiers
        self.kv_parking = kv_parking
        self.table = table
        self._stopping = stopping
        # One placement decision (plan, evictions, booking) at a time; loads run outside it.
        self.placement_lock = threading.RLock()
        # Cumulative, for /metrics: evictions of any kind (requests, moves, OOM, max_loaded_models).
        self.evictions_total = 0

    def engine(self, runtime: ModelRuntime) -> Engine:
        """The model's engine, created (and its footprint registered) on first use."""
        if runtime.engine is not None:
            return runtime.engine
        try:
            cls = engine_class(runtime.config.engine, runtime.config.modality)
        except NotImplementedError as exc:
            raise ModelNotAvailable(str(exc)) from exc
        weights = self.config.weights_file(runtime.config)
        if not weights.exists():
            raise ModelNotAvailable(
                f"The model {runtime.config.id!r} cannot be served: its weights {weights} are missing "
                "(./run.sh installs the default models)."
            )
        aux = self.config.aux_file(runtime.config)
        if aux is not None and not aux.exists():
            raise ModelNotAvailable(f"The model {runtime.config.id!r} cannot be served: its aux file {aux} is missing.")
        # Unset means every core (llama-cpp-python's own default would be half of them).
        engine = cls(
            runtime.config,
            weights,
            self.config.hardware.n_threads or os.cpu_count(),
            **({"aux": aux} if aux is not None else {}),
        )
        self.tiers.register(runtime.config.id, runtime.config.priority, engine.footprint(), runtime.config.moe_offload)
        self.tiers.set_keep_alive(runtime.config.id, self.keep_alive_secs(runtime.config))
        runtime.engine = engine
        return engine

    def keep_alive_secs(self, model: ModelConfig) -> float | None:
        """The model's idle unload time: its block's, else server.keep_alive_secs ("auto": 300 s
        on a GPU, never on a simulated device); None or negative: never (TierManager.set_keep_alive)."""
        secs = model.keep_alive_secs if model.keep_alive_secs is not None else self.config.server.keep_alive_secs
        if secs == "auto":
            return None if self.tiers.device.simulated else AUTO_KEEP_ALIVE_SECS
        return float(secs)  # negative: forever, as the ledger reads it

    def set_keep_alive(self, name: str, secs: float) -> float | None:
        """An Ollama request's keep_alive (seconds, negative: forever) for its model, from now."""
        runtime = self.table.resolve(name)
        self.engine(runtime)
        return self.tiers.set_keep_alive(runtime.config.id, secs)

    def unload_idle(self) -> None:
        """Idle unload: every second, demote the tier-1 models idle past their keep-alive, to
        tier 2 while the warm budget holds them, else to disk (recent_evictions: reason "idle")."""
        while not self._stopping.wait(IDLE_CHECK_SECS):
            for model_id in self.tiers.expired():
                runtime = self.table.models.get(model_id)
                if runtime is None or runtime.engine is None:
                    continue
                with runtime.load_lock, self.placement_lock:
                    # Leased for the move, so that no request starts on it meanwhile; a request
                    # that came since makes it busy (or no longer expired): left as it is.
                    if model_id not in self.tiers.expired() or not self.tiers.lease_if_idle(model_id):
                        continue
                    try:
                        runtime.wait_engine_idle()
                        to_tier = MemoryTier.TIER2 if self.tiers.warm_room_for(model_id) else MemoryTier.TIER3
                        self.demote(model_id, runtime.engine, to_tier)
                        self.tiers.record_eviction(Eviction(model_id, to_tier, "idle"), None)
                        self.evictions_total += 1
                        log.info("%s: idle past its keep_alive, demoted to %s", model_id, to_tier)
                    finally:
                        self.tiers.release(model_id, served=False)

    def prepare_chat(
        self, runtime: ModelRuntime, engine: Engine, work: ChatWork, limits: LimitsConfig
    ) -> tuple[ChatWork, TierSwitch]:
        """The (leased) model in tier 1 with room for the chat, and the chat prepared (rendered,
        tokenised, its grammar built): every refusal (a schema the grammar limits refuse, a
        prompt beyond the context) comes from here, before the request reports `started`."""
        switch = self.ensure_tier1(runtime, needed_context(work))
        work = engine.prepare_chat(work, limits)
        # No prepared tokens reads as an empty list: it fits nothing, as before.
        tokens = (work.prepared.tokens if work.prepared is not None else None) or []
        fits_model = bool(tokens) and len(tokens) < (engine.trained_context_len or len(tokens) + 1)
        if work.count_only:
            # Counted, never run: a prompt beyond the context is still counted, and no context grows for it.
            return work, switch
        if fits_model and not work.num_ctx and len(tokens) + work.max_tokens > engine.context_len:
            # The estimate from characters fell short: grow the context to the counted tokens.
            switch.absorb(self.ensure_tier1(runtime, len(tokens) + work.max_tokens))
        engine.check_context(work)
        return work, switch

    def ensure_tier1(self, runtime: ModelRuntime, context_len: int, exact: bool = False) -> TierSwitch:
        """Bring the (leased) model to tier 1 with at least `context_len` tokens of context (a
        load allocates at least the model's configured context_len), up to what the model was
        trained for; `exact` (a load that names its context: POST /v1/memory/tier, Lemonade's
        ctx_size) allocates that context, smaller than the configured one too, reloading a
        resident model whose context differs. Single-flight: concurrent requests wait for one load."""
        model_id = runtime.config.id
        with runtime.load_lock:
            engine = runtime.engine
            assert engine is not None
            trained = engine.trained_context_len or context_len
            if exact:
                if context_len > trained:
                    raise InvalidRequest(
                        f"context_len {context_len} is more than the {trained} tokens {model_id!r} was trained for.",
                        param="context_len",
                    )
                wanted = context_len
                if engine.loaded and engine.context_len == wanted:
                    return TierSwitch(previous_tier=MemoryTier.TIER1)
            elif engine.loaded and engine.context_len >= min(context_len, trained):
                return TierSwitch(previous_tier=MemoryTier.TIER1)
            else:
                wanted = min(max(context_len, runtime.config.context_len), trained)
            switch = TierSwitch(previous_tier=self.tiers.tier(model_id))
            with self.placement_lock:
                placement, evictions = self._plan(model_id, wanted)
                for eviction in evictions:
                    self._apply_eviction(eviction, for_model=model_id)
                switch.evicted = [e.model for e in evictions]
                self.tiers.book_tier1(model_id, placement)
            try:
                engine.unload()
                engine.cpu_expert_layers = placement.cpu_expert_layers
                switch.phases = engine.load(wanted, placement.gpu_layers)
                self._restore_parked(model_id, engine, switch.phases)
            except BaseException:
                runtime.load_failures += 1
                with self.placement_lock:
                    self.tiers.load_failed(model_id, weights_warm=bool(engine.warm_bytes))
                raise
            runtime.loads += 1
            self.tiers.note_load(model_id, switch.previous_tier, switch.phases.total_ms)
            log.info(
                "%s: %s -> tier 1 in %.0f ms (evicted %s)",
                model_id,
                switch.previous_tier,
                switch.phases.total_ms,
                switch.evicted or "nothing",
            )
            return switch

    def _restore_parked(self, model_id: str, engine: Engine, phases: LoadPhases) -> None:
        layout = engine.kv_layout()
        state = self.kv_parking.take(model_id, layout) if layout is not None else None
        if state is None:
            return
        started = time.perf_counter()
        phases.kv_restored_tokens = engine.restore(state)
        phases.kv_restore_ms = (time.perf_counter() - started) * 1000
        phases.total_ms += phases.kv_restore_ms

    def demote(self, model_id: str, engine: Engine, to_tier: MemoryTier, park: bool = True) -> None:
        """The worker's one way out of tier 1 (evictions, moves, disabling, MoE offload changes,
        pool removals), once no abandoned request is still inside the engine: the engine
        releases the bytes, then the ledger books them in `to_tier`. The conversation is parked
        first when KV parking is on and `park` (a model leaving for good drops it instead)."""
        runtime = self.table.models.get(model_id)
        if runtime is not None:
            runtime.wait_engine_idle()
        if not park:
            self.kv_parking.drop(model_id)
        elif self.kv_parking.enabled and engine.loaded:
            state = engine.park()
            if state is not None:
                self.kv_parking.park(model_id, state)
        if to_tier == MemoryTier.TIER3:
            engine.cool()
        else:
            engine.unload()
        self.tiers.demote(model_id, to_tier)

    def park_resident(self) -> None:
        """A stopping worker: park the conversations of the models still in tier 1 (those that
        left it were parked then), once no request is inside their engines."""
        if not self.kv_parking.enabled:
            return
        for model_id, runtime in self.table.models.items():
            engine = runtime.engine
            if engine is None or not engine.loaded or self.tiers.tier(model_id) != MemoryTier.TIER1:
                continue
            runtime.wait_engine_idle()
            state = engine.park()
            if state is not None:
                self.kv_parking.park(model_id, state)

    def _plan(self, model_id: str, context_len: int) -> tuple[Placement, list[Eviction]]:
        try:
            promotion = self.tiers.plan_promotion(model_id, context_len)
        except NoRoom as exc:
            raise NO_ROOM_ERRORS[exc.reason](exc.message) from exc
        return promotion.placement, promotion.evictions

    def _apply_eviction(self, eviction: Eviction, for_model: str | None) -> None:
        """Carry out a demotion the TierManager chose (the victim is idle: it holds no lease)."""
        engine = self.table.models[eviction.model].engine
        assert engine is not None
        self.demote(eviction.model, engine, eviction.to_tier)
        self.tiers.record_eviction(eviction, for_model)
        self.evictions_total += 1
        log.info("evicted %s to %s for %s (%s)", eviction.model, eviction.to_tier, for_model, eviction.reason)

    def evict_idle(self, for_model: str, reason: str) -> list[str]:
        """Evict every idle model in tier 1 to disk for `for_model` (a device OOM's retry)."""
        with self.placement_lock:
            victims = self.tiers.evictable(for_model, (MemoryTier.TIER1,))
            for victim in victims:
                self._apply_eviction(Eviction(victim.model_id, MemoryTier.TIER3, reason), for_model)
            return [v.model_id for v in victims]

    def move(self, name: str, target: MemoryTier, context_len: int | None) -> Placement:
        """POST /v1/memory/tier and startup staging: put an idle model in `target`.
        429 while the model is leased, 507 when it does not fit."""
        runtime = self.table.resolve(name)
        model_id = runtime.config.id
        with self.placement_lock:
            engine = self.engine(runtime)
            # Held while moving, so that no other promotion picks this model as a victim.
            if not self.tiers.lease_if_idle(model_id):
                raise ModelBusy(f"The model {model_id!r} is serving requests; retry when it is idle.")
        try:
            if target == MemoryTier.TIER1:
                self.ensure_tier1(runtime, context_len or runtime.config.context_len, exact=context_len is not None)
            elif target == MemoryTier.TIER2:
                self._warm(runtime, engine)
            else:
                with runtime.load_lock, self.placement_lock:
                    self.demote(model_id, engine, MemoryTier.TIER3)
        finally:
            self.tiers.release(model_id, served=False)
        return self.tiers.placement(model_id)

    def set_moe_offload(self, name: str, mode: str) -> dict[str, Any]:
        """POST /v1/models/{id}/moe-offload (spec §6): the mode of the model's next placement.
        An idle resident model is unloaded to tier 2 so that its next request loads it with the
        new placement ("now"); a busy one changes at its next load ("next_load"). A dense model
        takes the mode and ignores it. Not written back to the config."""
        if mode not in MOE_OFFLOAD_MODES:
            raise UnprocessableEntity(f"Unknown moe_offload mode {mode!r}; use off, auto or on.", param="mode")
        runtime = self.table.resolve(name, enabled_only=False)
        model_id = runtime.config.id
        with self.placement_lock:
            engine = self.engine(runtime)
            changed = self.tiers.moe_offload(model_id) != mode
            self.tiers.set_moe_offload(model_id, mode)
            busy = not self.tiers.lease_if_idle(model_id)  # an idle one: no request may load it meanwhile
        if not busy:
            try:
                if changed and engine.loaded and engine.footprint().expert_bytes:
                    with runtime.load_lock, self.placement_lock:
                        self.demote(model_id, engine, MemoryTier.TIER2)
            finally:
                self.tiers.release(model_id, served=False)
        return {
            "model": model_id,
            "moe_offload": mode,
            "applies": "next_load" if busy else "now",
            "placement": self.tiers.placement(model_id).as_dict(),
        }

    def empty_idle_slots(self, idle_secs: float) -> None:
        """server.kv_idle_timeout_secs: every few seconds, empty the KV of the slots of idle
        loaded models whose conversation has not been served for `idle_secs`."""
        while not self._stopping.wait(min(max(idle_secs / 4, 0.2), 30.0)):
            for model_id, runtime in list(self.table.models.items()):
                with self.placement_lock:
                    # No lease: no request can start meanwhile; no engine user: no abandoned one
                    # (its lease already released) is still stopping. A loaded engine is registered.
                    if (
                        runtime.engine is not None
                        and runtime.engine.loaded
                        and not self.tiers.leases(model_id)
                        and not runtime.engine_users
                    ):
                        dropped = runtime.engine.empty_idle_slots(idle_secs)
                        if dropped:
                            log.info("%s: emptied %d tokens of KV idle for %gs", model_id, dropped, idle_secs)

    def _warm(self, runtime: ModelRuntime, engine: Engine) -> None:
        model_id = runtime.config.id
        with runtime.load_lock:
            if engine.loaded:
                with self.placement_lock:
                    self.demote(model_id, engine, MemoryTier.TIER2)
                return
            with self.placement_lock:
                try:
                    evictions = self.tiers.plan_warm(model_id)
                except NoRoom as exc:
                    raise NO_ROOM_ERRORS[exc.reason](exc.message) from exc
                for eviction in evictions:
                    self._apply_eviction(eviction, for_model=model_id)
                self.tiers.book_tier2(model_id)
            try:
                engine.warm()
            except BaseException:
                with self.placement_lock:
                    self.tiers.warm_failed(model_id)
                raise
