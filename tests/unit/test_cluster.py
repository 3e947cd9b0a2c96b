"""Routing between several inference workers and the merged view (inference/transport/cluster.py)."""

from __future__ import annotations

import time
from typing import Any

from inference.transport.cluster import candidates, choose, merge_kv_park, merge_memory_status, merge_status
from inference.transport.wire import ModelPlace, WorkerAnnouncement

GIB = 1 << 30


def worker(
    name: str, free: int = 4 * GIB, queue: int = 0, ready: bool = True, **models: ModelPlace
) -> WorkerAnnouncement:
    return WorkerAnnouncement(
        worker_id=name,
        channel=f"hypnos.worker.{name}!x",
        host="box",
        pid=1,
        device="simulated",
        simulated=True,
        ready=ready,
        tier1_budget_bytes=4 * GIB,
        tier1_free_bytes=free,
        tier2_budget_bytes=8 * GIB,
        tier2_free_bytes=8 * GIB,
        queue_depth=queue,
        announced_at=time.time(),
        models=models,
    )


def cold(**extra: Any) -> ModelPlace:
    return ModelPlace(**extra)


def hot(**extra: Any) -> ModelPlace:
    return ModelPlace(tier="tier1_gpu_vram", tier1_bytes=GIB, weight_bytes=GIB, **extra)


def picked(workers: list[WorkerAnnouncement], name: str = "m", claimed: str | None = None) -> tuple[str, bool]:
    chosen = choose(candidates(workers, name), claimed)
    assert chosen is not None
    return chosen[0].worker.worker_id, chosen[1]


def test_a_request_goes_where_its_model_is_in_tier_1_then_tier_2():
    assert picked([worker("a", m=cold()), worker("b", free=GIB, m=hot())]) == ("b", False)
    warm = ModelPlace(tier="tier2_pinned_ram")
    assert picked([worker("a", m=cold()), worker("b", free=GIB, m=warm)]) == ("b", False)


def test_a_model_loaded_nowhere_goes_to_the_most_room_and_is_claimed():
    assert picked([worker("a", free=GIB, m=cold()), worker("b", free=3 * GIB, m=cold())]) == ("b", True)
    # Another request already placed it: the same worker, whatever the room.
    claimed = "hypnos.worker.a!x"
    assert picked([worker("a", free=GIB, m=cold()), worker("b", free=3 * GIB, m=cold())], claimed=claimed) == (
        "a",
        False,
    )
    # A claim of a worker process that has died since (its restarted process has a new channel)
    # binds nothing.
    assert picked(
        [worker("a", free=GIB, m=cold()), worker("b", free=3 * GIB, m=cold())], claimed="hypnos.worker.a!old"
    ) == (
        "b",
        True,
    )
    # Free room first; room that needs an (unleased) eviction after.
    busy = worker("a", free=GIB, m=cold(), other=hot())
    assert picked([busy, worker("b", free=2 * GIB, m=cold())]) == ("b", True)


def test_pins_disabled_models_and_stopping_workers_are_not_candidates():
    pinned = cold(workers=["b"])
    assert picked([worker("a", free=4 * GIB, m=pinned), worker("b", free=GIB, m=pinned)]) == ("b", True)
    assert candidates([worker("a", m=cold(enabled=False))], "m") == []
    stopping = worker("a", m=hot()).model_copy(update={"draining": True})
    assert picked([stopping, worker("b", m=cold())]) == ("b", True)


def test_aliases_route_like_the_id():
    assert picked([worker("a", m=cold()), worker("b", m=hot(aliases=["gpt-4o-mini"]))], "gpt-4o-mini") == ("b", False)


def test_replicas_spread_when_every_holder_is_busy():
    busy = hot(admitted=2, replicas=2)
    assert picked([worker("a", m=busy), worker("b", m=cold(replicas=2))]) == ("b", False)
    # One replica only: it waits for the worker that holds it.
    assert picked([worker("a", m=hot(admitted=2)), worker("b", m=cold())]) == ("a", False)
    # Two holders: the least busy.
    assert picked([worker("a", m=hot(admitted=3, replicas=2)), worker("b", m=hot(admitted=1, replicas=2))]) == (
        "b",
        False,
    )


def test_a_worker_still_staging_is_chosen_last():
    assert picked([worker("a", ready=False, m=hot()), worker("b", m=cold())]) == ("b", True)


def row(model: str, tier: str, leases: int = 0) -> dict[str, Any]:
    return {"id": model, "current_tier": tier, "active_leases": leases, "placement": {}}


def memory(name: str, used: int, *rows: dict[str, Any], evicted: int = 0) -> dict[str, Any]:
    return {
        "worker": {"worker_id": name, "device": "simulated"},
        "tier1_vram_used_bytes": used,
        "tier1_vram_free_bytes": 4 * GIB - used,
        "tier1_vram_real_free_bytes": None,
        "models": list(rows),
        "recent_evictions": [{"model": "x", "unix_ms": evicted}] if evicted else [],
        "evictions_total": 1 if evicted else 0,
        "capabilities": {},
    }


def test_the_memory_status_of_several_workers_is_one_view():
    merged = merge_memory_status(
        [
            memory("a", GIB, row("m", "tier3_nvme_ssd"), row("n", "tier1_gpu_vram"), evicted=5),
            memory("b", 2 * GIB, row("m", "tier1_gpu_vram", leases=1), row("n", "tier3_nvme_ssd"), evicted=9),
        ]
    )
    assert merged["tier1_vram_used_bytes"] == 3 * GIB
    assert merged["tier1_vram_real_free_bytes"] is None
    assert merged["evictions_total"] == 2
    by_id = {m["id"]: m for m in merged["models"]}
    assert by_id["m"]["worker"] == "b" and by_id["m"]["active_leases"] == 1
    assert [(p["worker"], p["current_tier"]) for p in by_id["m"]["placements"]] == [
        ("a", "tier3_nvme_ssd"),
        ("b", "tier1_gpu_vram"),
    ]
    assert by_id["n"]["worker"] == "a"
    assert [(e["worker"], e["unix_ms"]) for e in merged["recent_evictions"]] == [("b", 9), ("a", 5)]
    assert [w["worker_id"] for w in merged["workers"]] == ["a", "b"]
    assert merged["workers"][1]["tier1_vram_used_bytes"] == 2 * GIB


def test_one_worker_keeps_its_figures_and_says_where():
    merged = merge_memory_status([memory("a", GIB, row("m", "tier1_gpu_vram"))])
    assert merged["tier1_vram_used_bytes"] == GIB
    assert merged["models"][0]["worker"] == "a"
    assert merged["workers"][0]["worker_id"] == "a"


def parking(enabled: bool, used: int, *models: str) -> dict[str, Any]:
    return {"enabled": enabled, "max_bytes": GIB, "used_bytes": used, "models": [{"model": m} for m in models]}


def test_the_kv_parking_of_several_workers_is_summed_and_says_who_holds_each_model():
    merged = merge_kv_park([parking(True, 5, "m"), parking(False, 0)], ["a", "b"])
    assert merged == {"enabled": True, "max_bytes": 2 * GIB, "used_bytes": 5, "models": [{"model": "m", "worker": "a"}]}
    # In the memory status: only the workers that report parking count.
    with_park = {**memory("a", GIB), "kv_park": parking(True, 7, "n")}
    status = merge_memory_status([memory("b", GIB), with_park])
    assert status["kv_park"] == parking(True, 7, "n")
    assert "kv_park" not in merge_memory_status([memory("a", GIB), memory("b", GIB)])


def test_the_status_of_several_workers_names_where_each_model_is():
    def status(name: str, tier: str, ready: bool = True) -> dict[str, Any]:
        state = {"current_tier": tier, "admitted": 1, "generating": 0, "config": {}}
        return {"ready": ready, "simulated": True, "models": {"m": state}, "worker": name}

    merged = merge_status([status("a", "tier3_nvme_ssd", ready=False), status("b", "tier1_gpu_vram")])
    assert merged["ready"] is True
    assert merged["models"]["m"]["current_tier"] == "tier1_gpu_vram"
    assert merged["models"]["m"]["workers"] == {"a": "tier3_nvme_ssd", "b": "tier1_gpu_vram"}
    assert merged["models"]["m"]["admitted"] == 2
    assert merged["workers"] == ["a", "b"]
