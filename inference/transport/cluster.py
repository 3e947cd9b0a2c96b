"""Several inference workers (distributed deployment): who they are, where a request goes, and
one view of them all.

Each `manage.py runinference` announces itself (a wire.WorkerAnnouncement: its channel, device,
budgets, and each model's tier, leases and queue) in Redis every ANNOUNCE_SECS, under a key that
expires after ANNOUNCE_TTL_SECS: a worker killed or cut off stops being chosen once its key
lapses, and sooner in a web process that saw it miss an acknowledgement (`WorkerDirectory.lost`).
A worker that stops cleanly deletes its key first. The key is also how a web process tells a busy
worker, whose replies come late on a loaded machine, from a lost one (`WorkerDirectory.announces`,
inference/transport/client.py): it waits for a silent worker as long as the worker still announces itself.

A web process reads the announcements (at most every DIRECTORY_TTL_SECS) and routes each request
(`choose`): to a worker that holds the model in tier 1 (the least busy of them; a model whose
block asks for `replicas` gets another worker when every one that holds it is busy), else in
tier 2, else to the worker with the most tier-1 room for it without evicting a leased model.
A model loaded nowhere yet is claimed for its worker in Redis for CLAIM_MS, so that the requests
of every web process that arrive before the next announcements go to the same worker: a model
is loaded on one worker at a time. With no announcement at all, requests go to the shared
channel that every worker also listens on (one worker, or workers of an older version).

Control operations reach every worker that they concern (`control_targets`), and the statuses
are merged here into one view (`merge_status`, `merge_memory_status`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.exceptions import RedisError

from inference.transport.wire import ControlRequest, ModelPlace, WorkerAnnouncement
from models_registry.shared_state import shared_redis, state_key

log = logging.getLogger(__name__)

ANNOUNCE_SECS = 0.5
ANNOUNCE_TTL_SECS = 3.0
# After a request changed what a worker holds, it announces again at once, but not more often.
ANNOUNCE_MIN_GAP_SECS = 0.1
DIRECTORY_TTL_SECS = 0.25
CLAIM_MS = 5000
TIER_RANK = {"tier1_gpu_vram": 0, "tier2_pinned_ram": 1, "tier3_nvme_ssd": 2}
# Control operations every worker must apply (the pool and its limits), and those every worker answers.
BROADCAST_OPS = frozenset(
    {
        "add_model",
        "replace_model",
        "update_model",
        "remove_model",
        "enable",
        "disable",
        "set_limits",
        "keep_alive",
        "kv_park",
        "fault",
    }
)
GATHER_OPS = frozenset({"status", "memory_status"})


def index_key() -> str:
    return state_key("workers")


def worker_key(worker_id: str) -> str:
    return state_key("worker", worker_id)


def placing_key(model_id: str) -> str:
    return state_key("placing", model_id)


# -- the worker's side ---------------------------------------------------------------------


class Announcer:
    """Announces one worker until it withdraws."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._last = -1e9
        self.withdrawn = False

    def due(self) -> bool:
        """Whether an announcement after a change would not follow the last one too closely."""
        return not self.withdrawn and time.monotonic() - self._last >= ANNOUNCE_MIN_GAP_SECS

    async def announce(self, announcement: WorkerAnnouncement) -> None:
        if self.withdrawn:
            return
        self._last = time.monotonic()
        redis = shared_redis().client()
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(worker_key(self.worker_id), announcement.model_dump_json(), px=int(ANNOUNCE_TTL_SECS * 1000))
            pipe.sadd(index_key(), self.worker_id)
            await pipe.execute()

    async def withdraw(self) -> None:
        """Stop being chosen: the key goes now, not when it would have lapsed."""
        self.withdrawn = True
        async with shared_redis().client().pipeline(transaction=False) as pipe:
            pipe.delete(worker_key(self.worker_id))
            pipe.srem(index_key(), self.worker_id)
            await pipe.execute()


async def running_elsewhere(worker_id: str, host: str, pid: int) -> WorkerAnnouncement | None:
    """Another live process of this host that announces itself as `worker_id` (two workers
    started with the same id), if any."""
    import os

    raw = await shared_redis().client().get(worker_key(worker_id))
    if raw is None:
        return None
    try:
        other = WorkerAnnouncement.model_validate_json(raw)
    except ValidationError:
        return None
    if other.host != host or other.pid == pid:
        return None
    try:
        os.kill(other.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return other


# -- the web process's side ----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    worker: WorkerAnnouncement
    model_id: str
    place: ModelPlace

    @property
    def rank(self) -> int:
        return TIER_RANK.get(self.place.tier, 2)

    @property
    def load(self) -> tuple[int, int]:
        return self.place.admitted, self.worker.queue_depth


def find_model(worker: WorkerAnnouncement, name: str) -> tuple[str, ModelPlace] | None:
    place = worker.models.get(name)
    if place is not None:
        return name, place
    for model_id, place in worker.models.items():
        if name in place.aliases:
            return model_id, place
    return None


def candidates(workers: Iterable[WorkerAnnouncement], name: str) -> list[Candidate]:
    """The workers that may serve `name`: not stopping, the model in their pool, enabled, and
    the model's pins (if any) naming them."""
    found = []
    for worker in workers:
        if worker.draining:
            continue
        hit = find_model(worker, name)
        if hit is None:
            continue
        model_id, place = hit
        if not place.enabled or (place.workers and worker.worker_id not in place.workers):
            continue
        found.append(Candidate(worker, model_id, place))
    # Workers still staging at start-up come last.
    return sorted(found, key=lambda c: not c.worker.ready)


def choose(found: list[Candidate], claimed: str | None = None) -> tuple[Candidate, bool] | None:
    """Where the request goes, and whether that loads the model somewhere new (then the caller
    claims it). `claimed`: the channel of the worker process another request already placed the
    model on (a channel, not a worker id: a worker restarted since is a new process that holds
    nothing, so the claim no longer binds)."""
    if not found:
        return None
    ready = [c for c in found if c.worker.ready] or found
    holding = [c for c in ready if c.rank == 0]
    if holding:
        best = min(holding, key=lambda c: c.load)
        if best.place.admitted > 0 and len(holding) < best.place.replicas:
            others = [c for c in ready if c.rank > 0]
            if others:
                return _most_room(others), False
        return best, False
    warm = [c for c in ready if c.rank == 1]
    if warm:
        return min(warm, key=lambda c: c.load), False
    for c in ready:
        if c.worker.channel == claimed:
            return c, False
    return _most_room(ready), True


def _most_room(found: list[Candidate]) -> Candidate:
    """The worker that can take the model with the least eviction: the most free tier-1 bytes,
    then the most it could free without touching a leased model, then the shortest queue."""
    return max(
        found,
        key=lambda c: (c.worker.tier1_free_bytes, c.worker.room_for(c.model_id), -c.worker.queue_depth),
    )


class WorkerDirectory:
    """The live workers as this web process last read them from Redis."""

    def __init__(self) -> None:
        self._workers: list[WorkerAnnouncement] = []
        self._read_at = -1e9
        # Channels that missed an acknowledgement here, and when (wall time, as announced_at).
        self._lost: dict[str, float] = {}

    async def live(self) -> list[WorkerAnnouncement]:
        if time.monotonic() - self._read_at < DIRECTORY_TTL_SECS:
            return self._workers
        redis = shared_redis().client()
        ids = sorted(await redis.execute_command("SMEMBERS", index_key()))
        values = await redis.mget([worker_key(i) for i in ids]) if ids else []
        workers, gone = [], []
        for worker_id, raw in zip(ids, values, strict=True):
            if raw is None:
                gone.append(worker_id)
                continue
            try:
                worker = WorkerAnnouncement.model_validate_json(raw)
            except ValidationError:
                log.warning("ignoring the malformed announcement of worker %s", worker_id)
                continue
            lost_at = self._lost.get(worker.channel)
            # A channel that missed an acknowledgement here counts again once it has announced
            # itself since (alive but slow); a dead worker's announcement stops changing.
            if lost_at is None or worker.announced_at > lost_at + 2 * ANNOUNCE_SECS:
                workers.append(worker)
        if gone:
            await redis.execute_command("SREM", index_key(), *gone)
        self._lost = {c: at for c, at in self._lost.items() if time.time() - at < 10 * ANNOUNCE_TTL_SECS}
        self._workers, self._read_at = workers, time.monotonic()
        return workers

    async def announces(self, worker: WorkerAnnouncement) -> bool:
        """Whether this process of `worker` still announces itself: its key has not lapsed (the
        process killed, cut off, or its event loop stuck for ANNOUNCE_TTL_SECS), nor been
        withdrawn (stopping) or taken over by a process started again since (a new channel)."""
        try:
            raw = await shared_redis().client().get(worker_key(worker.worker_id))
        except (OSError, RedisError):
            return False
        if raw is None:
            return False
        try:
            return WorkerAnnouncement.model_validate_json(raw).channel == worker.channel
        except ValidationError:
            return False

    def lost(self, channel: str) -> None:
        self._lost[channel] = time.time()
        self._workers = [w for w in self._workers if w.channel != channel]

    def forget(self) -> None:
        """Read Redis again at the next request (tests, and after a pool change)."""
        self._read_at = -1e9

    async def route(self, name: str, exclude: frozenset[str] = frozenset()) -> WorkerAnnouncement | None:
        """The worker a request for `name` goes to; None: the shared channel (no announcement)."""
        workers = [w for w in await self.live() if w.channel not in exclude]
        if not workers:
            return None
        found = candidates(workers, name)
        if not found:
            # No worker may serve it (unknown, disabled, pinned elsewhere): one answers why.
            return next((w for w in workers if not w.draining), workers[0])
        claim = placing_key(found[0].model_id)
        redis = shared_redis().client()
        claimed = await redis.get(claim) if all(c.rank == 2 for c in found) else None
        picked = choose(found, claimed)
        assert picked is not None
        chosen, fresh = picked
        if fresh:
            won = await redis.set(claim, chosen.worker.channel, nx=True, px=CLAIM_MS)
            if not won:
                other = await redis.get(claim)
                chosen = next((c for c in found if c.worker.channel == other), chosen)
        return chosen.worker

    async def control_targets(self, request: ControlRequest) -> list[WorkerAnnouncement] | None:
        """The workers a control operation goes to; None: the shared channel."""
        workers = await self.live()
        if not workers:
            return None
        op, args = request.op, request.args
        if op in GATHER_OPS or op in BROADCAST_OPS:
            return workers
        name = str(args.get("model", ""))
        named = args.get("worker")
        if named is not None:
            return [w for w in workers if w.worker_id == named]
        found = candidates(workers, name)
        if op == "move" and args.get("target_tier") != "tier1_gpu_vram":
            target = TIER_RANK[str(args.get("target_tier"))]
            above = [c.worker for c in found if c.rank < target]
            if above:
                return above
        if op in ("move", "moe_offload") and found:
            held = min(found, key=lambda c: c.rank)
            if op == "moe_offload" or held.rank == 0:
                return [held.worker]
        chosen = await self.route(name)
        return [chosen] if chosen is not None else None


# -- one view of every worker --------------------------------------------------------------


def merge_status(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' `status` as one: each model from the worker where it is in the best
    tier (`worker`), with where else it is (`workers`)."""
    if len(results) == 1:
        return results[0]
    models: dict[str, dict[str, Any]] = {}
    for status in results:
        for model_id, state in status["models"].items():
            best = models.get(model_id)
            if best is None or TIER_RANK.get(state["current_tier"], 2) < TIER_RANK.get(best["current_tier"], 2):
                here = {**state, "worker": status.get("worker"), "workers": best["workers"] if best else {}}
                if best is not None:
                    here["admitted"] = here.get("admitted", 0) + best.get("admitted", 0)
                    here["generating"] = here.get("generating", 0) + best.get("generating", 0)
                models[model_id] = here
            else:
                best["admitted"] = best.get("admitted", 0) + state.get("admitted", 0)
                best["generating"] = best.get("generating", 0) + state.get("generating", 0)
            models[model_id]["workers"][status.get("worker", "")] = state["current_tier"]
    first = results[0]
    return {
        **first,
        "ready": any(s["ready"] for s in results),
        "simulated": all(s["simulated"] for s in results),
        "models": models,
        "workers": [s.get("worker") for s in results],
    }


_SUMMED = (
    "tier1_vram_used_bytes",
    "tier1_vram_free_bytes",
    "tier1_vram_real_free_bytes",
    "tier1_vram_real_total_bytes",
    "tier1_vram_unaccounted_bytes",
    "tier1_vram_effective_free_bytes",
    "tier2_pinned_ram_used_bytes",
    "tier2_pinned_ram_free_bytes",
    "process_footprint_bytes",
    "process_memory_bytes",
    "evictions_total",
)


def merge_memory_status(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' memory status as one (spec §14's shape): the budgets summed, each
    model's row from the worker where it is in the best tier, with `worker` and every worker
    that has it (`placements`), the evictions of all, and each worker's own figures in `workers`."""
    workers = []
    for status in results:
        own = {key: status.get(key) for key in _SUMMED}
        workers.append(
            {**status.get("worker", {}), **own, "capabilities": status.get("capabilities"), "gpu": status.get("gpu")}
        )
    models: dict[str, dict[str, Any]] = {}
    placements: dict[str, list[dict[str, Any]]] = {}
    for status in results:
        worker_id = status.get("worker", {}).get("worker_id")
        for row in status["models"]:
            placements.setdefault(row["id"], []).append(
                {
                    "worker": worker_id,
                    "current_tier": row["current_tier"],
                    "active_leases": row.get("active_leases", 0),
                    "loads": row.get("loads", 0),
                    "placement": row.get("placement"),
                }
            )
            best = models.get(row["id"])
            if best is None or TIER_RANK.get(row["current_tier"], 2) < TIER_RANK.get(best["current_tier"], 2):
                models[row["id"]] = {**row, "worker": worker_id}
    for model_id, row in models.items():
        row["placements"] = placements[model_id]
    evictions = [
        {**eviction, "worker": status.get("worker", {}).get("worker_id")}
        for status in results
        for eviction in status.get("recent_evictions", [])
    ]
    evictions.sort(key=lambda e: int(e.get("unix_ms", 0)), reverse=True)
    merged = {**results[0], "models": list(models.values()), "recent_evictions": evictions, "workers": workers}
    parking = [s for s in results if "kv_park" in s]
    if parking:
        merged["kv_park"] = merge_kv_park(
            [s["kv_park"] for s in parking], [s.get("worker", {}).get("worker_id") for s in parking]
        )
    for key in _SUMMED:
        values = [s.get(key) for s in results]
        merged[key] = None if all(v is None for v in values) else sum(v or 0 for v in values)
    merged["process_memory_cap_bytes"] = results[0].get("process_memory_cap_bytes")
    return merged


def merge_kv_park(results: list[dict[str, Any]], worker_ids: Sequence[str | None]) -> dict[str, Any]:
    """Several workers' KV parking (GET and POST /v1/memory/kv-park, `kv_park` of the memory
    status) as one: the caps and bytes summed, each parked model with the worker that holds it."""
    if len(results) == 1:
        return results[0]
    return {
        "enabled": any(r["enabled"] for r in results),
        "max_bytes": sum(r["max_bytes"] for r in results),
        "used_bytes": sum(r["used_bytes"] for r in results),
        "models": [{**m, "worker": w} for r, w in zip(results, worker_ids, strict=True) for m in r["models"]],
    }
