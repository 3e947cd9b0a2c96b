"""The tier manager's ledger and decisions: what is booked where, what may be evicted, in which
order, and why. It moves no bytes itself; the worker carries out its plans with the engines.

Rules (spec §14, ARCHITECTURE.md "Memory tiers"):
- a leased model is never evicted or moved;
- eviction weighs priority first (`realtime_pinned` is never evicted), then the cost of losing a
  model: its reload estimate times its request rate, decayed over about ten minutes;
- an evicted model goes to tier 2 when its weights fit the warm budget, else to tier 3;
- when nothing can make room the request gets 507 with the reason.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from memory.device import Device, HardwareLimits, process_memory_bytes
from memory.planner import Footprint, cold_placement, plan_placement, warm_placement
from memory.tiers import MemoryTier, Placement

PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2, "realtime_pinned": 3}
RATE_WINDOW_SECS = 600.0
RECENT_EVICTIONS = 20
# A keep-alive this long (~317 years) is forever: its expiry would pass what datetime holds.
FOREVER_SECS = 1e10
# Load speeds assumed before a model's own loads have been measured.
DISK_READ_BYTES_PER_S = 1.5e9
RAM_LOAD_BYTES_PER_S = 8e9


class NoRoom(Exception):
    """Nothing can make room; `reason` is the spec's error type."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class DecayingRate:
    """Requests per minute, each request's weight decaying with a time constant of ten minutes."""

    def __init__(self, clock: Any = time.monotonic):
        self.clock = clock
        self.value = 0.0
        self.at = clock()

    def tick(self) -> None:
        self.value = self._decayed() + 1.0
        self.at = self.clock()

    def per_minute(self) -> float:
        return self._decayed() / (RATE_WINDOW_SECS / 60)

    def _decayed(self) -> float:
        return self.value * math.exp(-(self.clock() - self.at) / RATE_WINDOW_SECS)


@dataclass
class Eviction:
    model: str
    to_tier: MemoryTier
    reason: str


@dataclass
class Promotion:
    placement: Placement
    evictions: list[Eviction]


@dataclass
class ModelEntry:
    model_id: str
    priority: str
    footprint: Footprint
    tier: MemoryTier = MemoryTier.TIER3
    placement: Placement = field(default_factory=lambda: Placement.on_disk(0))
    leases: int = 0
    requests_served: int = 0
    last_used: float = 0.0
    # Measured load times into tier 1, by the tier the load started from.
    load_ms: dict[MemoryTier, float] = field(default_factory=dict)
    rate: DecayingRate = field(default_factory=DecayingRate)
    # MoE offload (spec §6): "off", "auto" or "on"; the planner ignores it for dense models.
    moe_offload: str = "off"
    # Idle unload (server.keep_alive_secs): seconds idle in tier 1 before the worker demotes
    # the model; None: never.
    keep_alive_secs: float | None = None

    def expires_in(self, now: float) -> float | None:
        """Seconds until idle unload demotes the model (0 when due); None when it will not:
        not in tier 1, leased, or kept forever."""
        if self.tier != MemoryTier.TIER1 or self.leases or self.keep_alive_secs is None:
            return None
        return max(self.last_used + self.keep_alive_secs - now, 0.0)

    @property
    def rank(self) -> int:
        return PRIORITY_RANK[self.priority]

    def tier1_bytes(self) -> int:
        if self.tier != MemoryTier.TIER1:
            return 0
        return self.placement.vram_weight_bytes + self.placement.vram_kv_and_workspace_bytes

    def tier2_bytes(self) -> int:
        return self.placement.pinned_ram_bytes if self.tier in (MemoryTier.TIER1, MemoryTier.TIER2) else 0

    def reload_estimate_ms(self, from_tier: MemoryTier) -> float:
        if from_tier in self.load_ms:
            return self.load_ms[from_tier]
        speed = RAM_LOAD_BYTES_PER_S if from_tier == MemoryTier.TIER2 else DISK_READ_BYTES_PER_S
        return self.footprint.weights_bytes / speed * 1000


class TierManager:
    """Thread-safe ledger of the three tiers for every model of the pool."""

    def __init__(self, device: Device, limits: HardwareLimits, clock: Any = time.monotonic):
        self.device = device
        self.limits = limits
        self.clock = clock
        self.entries: dict[str, ModelEntry] = {}
        self.recent_evictions: deque[dict[str, Any]] = deque(maxlen=RECENT_EVICTIONS)
        self.lock = threading.RLock()
        # Lemonade's max_loaded_models: at most this many models in tier 1 (None: memory decides).
        self.max_resident: int | None = None

    # -- registration and bookkeeping --------------------------------------------------------

    def register(self, model_id: str, priority: str, footprint: Footprint, moe_offload: str = "off") -> ModelEntry:
        with self.lock:
            entry = ModelEntry(
                model_id,
                priority,
                footprint,
                placement=cold_placement(footprint),
                rate=DecayingRate(self.clock),
                last_used=self.clock(),
                moe_offload=moe_offload,
            )
            self.entries[model_id] = entry
            return entry

    def set_keep_alive(self, model_id: str, secs: float | None) -> float | None:
        """How long the model may sit idle in tier 1 (None, negative, or beyond any date a status
        can show: forever); counted from its last use. The value kept (None: forever)."""
        forever = secs is None or not math.isfinite(secs) or secs < 0 or secs >= FOREVER_SECS
        kept = None if forever else secs
        with self.lock:
            if model_id in self.entries:
                self.entries[model_id].keep_alive_secs = kept
        return kept

    def expired(self) -> list[str]:
        """The idle tier-1 models whose keep-alive has run out, the longest idle first."""
        with self.lock:
            now = self.clock()
            due = [e for e in self.entries.values() if e.expires_in(now) == 0.0]
            return [e.model_id for e in sorted(due, key=lambda e: e.last_used)]

    def expires_at(self, model_id: str) -> str | None:
        """When idle unload will demote the model (ISO 8601 UTC); None when it will not."""
        with self.lock:
            entry = self.entries.get(model_id)
            return _expiry_iso(entry.expires_in(self.clock())) if entry is not None else None

    def warm_room_for(self, model_id: str) -> bool:
        """Whether the model's weights fit the warm budget (tier 2) if it left tier 1 now."""
        with self.lock:
            e = self.entries[model_id]
            return e.footprint.weights_bytes <= self.tier2_budget - self.tier2_used() + e.tier2_bytes()

    def set_priority(self, model_id: str, priority: str) -> None:
        with self.lock:
            if model_id in self.entries:
                self.entries[model_id].priority = priority

    def forget(self, model_id: str) -> None:
        """Drop a model that left the pool; it must have been demoted first (its engine holds
        no tier-1 bytes the ledger would lose)."""
        with self.lock:
            entry = self.entries.get(model_id)
            if entry is not None and entry.tier == MemoryTier.TIER1:
                raise ValueError(f"{model_id} is in tier 1: demote it before forgetting it")
            self.entries.pop(model_id, None)

    def lease(self, model_id: str, request: bool = True) -> None:
        """Pin the model where it is; `request` counts it in the model's request rate."""
        with self.lock:
            entry = self.entries[model_id]
            entry.leases += 1
            if request:
                entry.rate.tick()

    def release(self, model_id: str, served: bool = True) -> None:
        with self.lock:
            entry = self.entries[model_id]
            entry.leases -= 1
            entry.last_used = self.clock()
            if served:
                entry.requests_served += 1

    # -- transitions: the only ways a model's tier changes ---------------------------------------
    #
    # A model enters tier 1 by `book_tier1` (before its load starts, so concurrent plans see the
    # bytes) and leaves it only by `demote`: evictions, moves by hand, disabling, MoE offload
    # changes, pool removals and failed loads all end there.

    def book_tier1(self, model_id: str, placement: Placement) -> None:
        """Book `placement` in tier 1 for the model about to load (or reload with a larger
        context: a resident model takes its new placement)."""
        with self.lock:
            self._set_tier(self.entries[model_id], MemoryTier.TIER1, placement)

    def book_tier2(self, model_id: str) -> None:
        """Book the weights of a model on disk in tier 2 (warming); a resident model reaches
        tier 2 by `demote` instead."""
        with self.lock:
            entry = self.entries[model_id]
            if entry.tier == MemoryTier.TIER1:
                raise ValueError(f"{model_id} is in tier 1: demote it to tier 2")
            self._set_tier(entry, MemoryTier.TIER2, warm_placement(entry.footprint))

    def demote(self, model_id: str, to_tier: MemoryTier) -> None:
        """The one way out of tier 1 (and from tier 2 to disk): the model's bytes are booked
        in `to_tier` once its engine has released them."""
        if to_tier == MemoryTier.TIER1:
            raise ValueError("demote goes to tier 2 or 3; book_tier1 promotes")
        with self.lock:
            entry = self.entries[model_id]
            warm = to_tier == MemoryTier.TIER2
            self._set_tier(entry, to_tier, warm_placement(entry.footprint) if warm else cold_placement(entry.footprint))

    def load_failed(self, model_id: str, weights_warm: bool) -> None:
        """A load booked by `book_tier1` failed: the model goes back to tier 2 when its engine
        still holds the weights, else to disk (through `demote`)."""
        self.demote(model_id, MemoryTier.TIER2 if weights_warm else MemoryTier.TIER3)

    def warm_failed(self, model_id: str) -> None:
        """Warming booked by `book_tier2` failed: the model is on disk only."""
        self.demote(model_id, MemoryTier.TIER3)

    def set_max_resident(self, count: int | None) -> None:
        """Lemonade's max_loaded_models: at most `count` models in tier 1 (None: memory decides);
        it applies from the next promotion."""
        with self.lock:
            self.max_resident = count

    def lease_if_idle(self, model_id: str) -> bool:
        """Lease the model for a move (not counted as a request) when nothing leases it; False
        while it serves, so the caller can answer 429."""
        with self.lock:
            if self.entries[model_id].leases:
                return False
            self.lease(model_id, request=False)
            return True

    @staticmethod
    def _set_tier(entry: ModelEntry, tier: MemoryTier, placement: Placement) -> None:
        entry.tier = tier
        entry.placement = placement

    # -- reads -------------------------------------------------------------------------------

    def __contains__(self, model_id: object) -> bool:
        """Whether the model is registered (its engine exists and its footprint is known)."""
        with self.lock:
            return model_id in self.entries

    def placement(self, model_id: str) -> Placement:
        """Where the model's bytes are booked now; on disk for a model not registered yet."""
        with self.lock:
            entry = self.entries.get(model_id)
            return entry.placement if entry is not None else Placement.on_disk(0)

    def tier(self, model_id: str) -> MemoryTier:
        with self.lock:
            entry = self.entries.get(model_id)
            return entry.tier if entry is not None else MemoryTier.TIER3

    def leases(self, model_id: str) -> int:
        with self.lock:
            entry = self.entries.get(model_id)
            return entry.leases if entry is not None else 0

    def reload_estimate_ms(self, model_id: str) -> float | None:
        """The estimated load time into tier 1 from where the model is; None when it is there
        or not registered."""
        with self.lock:
            entry = self.entries.get(model_id)
            if entry is None or entry.tier == MemoryTier.TIER1:
                return None
            return entry.reload_estimate_ms(entry.tier)

    def moe_offload(self, model_id: str) -> str:
        with self.lock:
            return self.entries[model_id].moe_offload

    def evictions(self) -> list[dict[str, Any]]:
        """The recent evictions, newest first (spec §14 recent_evictions)."""
        with self.lock:
            return list(self.recent_evictions)

    def note_load(self, model_id: str, from_tier: MemoryTier, ms: float) -> None:
        with self.lock:
            self.entries[model_id].load_ms[from_tier] = ms

    def record_eviction(self, eviction: Eviction, for_model: str | None) -> None:
        with self.lock:
            self.recent_evictions.appendleft(
                {
                    "model": eviction.model,
                    "for_model": for_model,
                    "reason": eviction.reason,
                    "to_tier": str(eviction.to_tier),
                    "unix_ms": int(time.time() * 1000),
                }
            )

    # -- budgets -----------------------------------------------------------------------------

    @property
    def tier1_budget(self) -> int:
        return self.device.capabilities.usable_vram_budget_bytes

    @property
    def tier2_budget(self) -> int:
        return self.device.capabilities.pinned_ram_budget_bytes

    def tier1_used(self) -> int:
        with self.lock:
            return sum(e.tier1_bytes() for e in self.entries.values())

    def tier2_used(self) -> int:
        with self.lock:
            return sum(e.tier2_bytes() for e in self.entries.values())

    def tier1_counters(self) -> dict[str, int | None]:
        """Booked, free, and what the device itself reports (spec §14)."""
        used = self.tier1_used()
        free = max(self.tier1_budget - used, 0)
        real = self.device.real_vram()
        if real is None:
            return {
                "used": used,
                "free": free,
                "real_free": None,
                "real_total": None,
                "unaccounted": 0,
                "effective_free": free,
            }
        real_free, real_total = real
        unaccounted = max(real_total - real_free - used, 0)
        return {
            "used": used,
            "free": free,
            "real_free": real_free,
            "real_total": real_total,
            "unaccounted": unaccounted,
            "effective_free": min(free, real_free),
        }

    # -- decisions ---------------------------------------------------------------------------

    def evictable(self, for_model: str, tiers: tuple[MemoryTier, ...], leased_too: bool = False) -> list[ModelEntry]:
        """Idle models in `tiers` that the requesting model may displace, cheapest loss first;
        `leased_too`: the leased ones as well, as if idle (a plan never carried out)."""
        requester = self.entries[for_model]
        found = [
            e
            for e in self.entries.values()
            if e.model_id != for_model
            and e.tier in tiers
            and (e.leases == 0 or leased_too)
            and e.priority != "realtime_pinned"
            and e.rank <= requester.rank
        ]
        return sorted(found, key=lambda e: (e.rank, self._loss_cost(e), e.last_used))

    def _loss_cost(self, entry: ModelEntry) -> float:
        return entry.reload_estimate_ms(MemoryTier.TIER3) * entry.rate.per_minute()

    def plan_promotion(self, model_id: str, context_len: int, leased_too: bool = False) -> Promotion:
        """The placement for `model_id` in tier 1 and the evictions that make room for it,
        preferring a whole placement with evictions to a partial one without. `leased_too`
        plans as if the leased models were idle: a question (held_by_leases), never carried out."""
        with self.lock:
            entry = self.entries[model_id]
            own = entry.tier1_bytes()
            free = self.tier1_counters()["effective_free"] + own  # type: ignore[operator]
            victims = self.evictable(model_id, (MemoryTier.TIER1,), leased_too)
            fp, ratio, moe = entry.footprint, self.limits.min_gpu_layer_ratio, entry.moe_offload
            # Whole with the experts where the mode puts them, then (moe_offload "auto") whole
            # with some experts in tier 2, then a layer split: each with the fewest evictions.
            attempts = [
                ("on" if moe == "on" else "off", True),
                *([("auto", True)] if moe == "auto" else []),
                (moe, False),
            ]
            chosen = None
            for mode, whole in attempts:
                chosen = chosen or self._fewest_victims(fp, context_len, free, ratio, victims, whole, mode)
            if chosen is None:
                raise NoRoom(
                    "insufficient_vram_or_ram",
                    f"The model {model_id!r} needs {fp.resident_bytes(context_len)} bytes in tier 1 "
                    f"({context_len} tokens of context); {free} are free and "
                    f"{sum(v.tier1_bytes() for v in victims)} more could be freed from idle models "
                    f"(budget {self.tier1_budget}, min_gpu_layer_ratio {ratio}).",
                )
            placement, n = chosen
            reason = "full_gpu_placement" if placement.gpu_layers == fp.n_layers and n else "memory_budget"
            chosen_victims = victims[:n] + self._over_count(model_id, victims[n:], n)
            evictions = self._destinations(chosen_victims, reason, placement.pinned_ram_bytes)
            for eviction in evictions[n:]:
                eviction.reason = "max_loaded_models"
            evictions += self._warm_room(model_id, placement.pinned_ram_bytes, evictions)
            self._check_process_cap(entry, placement, evictions)
            return Promotion(placement, evictions)

    def held_by_leases(self, model_id: str, context_len: int) -> list[str]:
        """The other models in tier 1 that requests lease now, when `model_id` (out of tier 1)
        would fit there with `context_len` tokens were they idle: a request that may wait (a
        batch's line) waits for them rather than fail. [] when nothing leased is in the way or
        the model would not fit either way."""
        with self.lock:
            if self.entries[model_id].tier == MemoryTier.TIER1:
                return []
            leased = [
                e.model_id
                for e in self.entries.values()
                if e.model_id != model_id and e.tier == MemoryTier.TIER1 and e.leases
            ]
            if not leased:
                return []
            try:
                self.plan_promotion(model_id, context_len, leased_too=True)
            except NoRoom:
                return []
            return leased

    def _over_count(self, model_id: str, rest: list[ModelEntry], chosen: int) -> list[ModelEntry]:
        """More idle models to evict, least recently used first within priority, while tier 1
        would hold more than `max_resident` models."""
        if self.max_resident is None:
            return []
        resident = [e for e in self.entries.values() if e.tier == MemoryTier.TIER1 and e.model_id != model_id]
        excess = len(resident) - chosen - (self.max_resident - 1)
        if excess <= 0:
            return []
        lru = sorted(rest, key=lambda e: (e.rank, e.last_used))
        if len(lru) < excess:
            raise NoRoom(
                "insufficient_vram_or_ram",
                f"max_loaded_models is {self.max_resident} and the models in tier 1 are busy.",
            )
        return lru[:excess]

    def _fewest_victims(
        self,
        fp: Footprint,
        context_len: int,
        free: int,
        ratio: float,
        victims: list[ModelEntry],
        whole: bool,
        moe_offload: str,
    ) -> tuple[Placement, int] | None:
        freed = 0
        for n in range(len(victims) + 1):
            if n:
                freed += victims[n - 1].tier1_bytes()
            placement = plan_placement(fp, context_len, free + freed, ratio, moe_offload)
            if placement is not None and (not whole or placement.gpu_layers == fp.n_layers):
                return placement, n
        return None

    def _destinations(self, victims: list[ModelEntry], reason: str, reserved_tier2: int) -> list[Eviction]:
        """Each victim goes warm to tier 2 while the warm budget holds it, else to disk."""
        room = self.tier2_budget - self.tier2_used() - reserved_tier2
        evictions = []
        for victim in victims:
            room += victim.tier2_bytes()
            if victim.footprint.weights_bytes <= room:
                room -= victim.footprint.weights_bytes
                evictions.append(Eviction(victim.model_id, MemoryTier.TIER2, reason))
            else:
                evictions.append(Eviction(victim.model_id, MemoryTier.TIER3, reason))
        return evictions

    def _warm_room(self, model_id: str, needed: int, planned: list[Eviction]) -> list[Eviction]:
        """Tier-2 models to send to disk so that `needed` warm bytes fit next to `planned`."""
        entry = self.entries[model_id]
        moving = {e.model for e in planned}
        used = (
            self.tier2_used()
            - entry.tier2_bytes()
            + sum(
                self.entries[e.model].footprint.weights_bytes - self.entries[e.model].tier2_bytes()
                for e in planned
                if e.to_tier == MemoryTier.TIER2
            )
        )
        extra = []
        for victim in self.evictable(model_id, (MemoryTier.TIER2,)):
            if used + needed <= self.tier2_budget:
                break
            if victim.model_id not in moving:
                used -= victim.tier2_bytes()
                extra.append(Eviction(victim.model_id, MemoryTier.TIER3, "memory_budget"))
        if used + needed > self.tier2_budget:
            raise NoRoom(
                "insufficient_vram_or_ram",
                f"The model {model_id!r} needs {needed} bytes of warm host memory; the tier-2 budget "
                f"is {self.tier2_budget} and {used} of it is held by models that cannot move now.",
            )
        return extra

    def set_moe_offload(self, model_id: str, mode: str) -> None:
        """The model's MoE offload mode, for its next placement."""
        with self.lock:
            self.entries[model_id].moe_offload = mode

    def plan_warm(self, model_id: str) -> list[Eviction]:
        """Evictions to disk that make room to hold `model_id`'s weights in tier 2."""
        with self.lock:
            entry = self.entries[model_id]
            return self._warm_room(model_id, entry.footprint.weights_bytes, [])

    def _check_process_cap(self, entry: ModelEntry, placement: Placement, evictions: list[Eviction]) -> None:
        cap = self.limits.max_process_memory_bytes
        if cap is None:
            return
        added = placement.vram_kv_and_workspace_bytes
        if entry.tier == MemoryTier.TIER3:
            added += entry.footprint.weights_bytes
        released = 0
        for eviction in evictions:
            victim = self.entries[eviction.model]
            released += victim.placement.vram_kv_and_workspace_bytes if victim.tier == MemoryTier.TIER1 else 0
            if eviction.to_tier == MemoryTier.TIER3:
                released += victim.footprint.weights_bytes
        projected = process_memory_bytes() + added - released
        if projected > cap:
            raise NoRoom(
                "process_memory_cap",
                f"Loading {entry.model_id!r} would take the process to about {projected} bytes, above "
                f"hardware.max_process_memory_bytes ({cap}).",
            )

    # -- status ------------------------------------------------------------------------------

    def model_status(self, model_id: str) -> dict[str, Any]:
        with self.lock:
            e = self.entries[model_id]
            room = self.tier2_budget - self.tier2_used() + e.tier2_bytes()
            lands = MemoryTier.TIER2 if e.footprint.weights_bytes <= room else MemoryTier.TIER3
            return {
                "total_weight_bytes": e.footprint.weights_bytes,
                "priority": e.priority,
                "current_tier": str(e.tier),
                "placement": e.placement.as_dict(),
                "active_leases": e.leases,
                "idle_seconds": round(self.clock() - e.last_used, 1) if e.leases == 0 else 0.0,
                "total_requests_served": e.requests_served,
                "requests_per_minute": round(e.rate.per_minute(), 3),
                "reload_estimate_ms": round(e.reload_estimate_ms(lands), 1),
                "moe_offload": e.moe_offload,
                "expert_bytes": e.footprint.expert_bytes,
                "keep_alive_secs": e.keep_alive_secs if e.keep_alive_secs is not None else -1,
                "expires_at": _expiry_iso(e.expires_in(self.clock())),
            }


def _expiry_iso(expires_in: float | None) -> str | None:
    """When idle unload is due, as an ISO 8601 UTC time; None when it is not coming."""
    if expires_in is None:
        return None
    return datetime.fromtimestamp(time.time() + expires_in, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
