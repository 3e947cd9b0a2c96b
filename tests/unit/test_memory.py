"""The tier manager's core, table-tested with synthetic footprints (no engine, no Django)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypnos_site.config import BASE_DIR, load_config
from memory.device import DeviceCapabilities, Device, HardwareLimits, probe_device
from memory.gguf import read_gguf
from memory.manager import DecayingRate, NoRoom, TierManager
from memory.planner import Footprint, footprint_from_gguf, plan_placement
from memory.tiers import MemoryTier

MB = 1_000_000
# 10 layers of 10 MB, 20 MB of other tensors, 1 KB of KV per token, 30 MB workspace.
FP = Footprint(layer_bytes=(10 * MB,) * 10, other_bytes=20 * MB, kv_bytes_per_token=1000, workspace_bytes=30 * MB)
CTX = 10_000  # 10 MB of KV: resident total 160 MB


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limits(**overrides: object) -> HardwareLimits:
    values = dict(simulated_vram_bytes=200 * MB, vram_reserve_bytes=0, pinned_ram_budget_bytes=1000 * MB,
                  max_process_memory_bytes=None, min_gpu_layer_ratio=0.5)
    values.update(overrides)
    return HardwareLimits(**values)  # type: ignore[arg-type]


def manager(tier1: int = 200 * MB, tier2: int = 1000 * MB, clock: Clock | None = None, **extra: object) -> TierManager:
    caps = DeviceCapabilities("Cpu", "None", "simulated", tier1, tier1, tier2, 8 << 30, True, 8 << 30)
    return TierManager(Device(caps), limits(**extra), clock=clock or Clock())


def resident(tm: TierManager, model: str, priority: str = "normal", fp: Footprint = FP) -> None:
    tm.register(model, priority, fp)
    tm.commit(model, MemoryTier.TIER1, tm.plan_promotion(model, CTX).placement)


def test_a_model_that_fits_is_placed_whole():
    plan = plan_placement(FP, CTX, 160 * MB, 0.5)
    assert plan is not None and plan.gpu_layers == 10 and plan.pinned_ram_layers == 0
    assert plan.vram_weight_bytes == 120 * MB and plan.vram_kv_and_workspace_bytes == 40 * MB
    assert plan.allocated_context_len == CTX


def test_a_tight_budget_gives_a_partial_placement_with_its_kv():
    plan = plan_placement(FP, CTX, 100 * MB, 0.5)
    # k layers need 10k MB of weights + k MB of KV + 30 MB workspace <= 100 MB -> k = 6
    assert plan is not None and (plan.gpu_layers, plan.pinned_ram_layers) == (6, 4)
    assert plan.vram_weight_bytes == 60 * MB and plan.vram_kv_and_workspace_bytes == 36 * MB
    assert plan.pinned_ram_bytes == 120 * MB - 60 * MB + 4 * MB


def test_below_the_minimum_layer_ratio_there_is_no_placement():
    assert plan_placement(FP, CTX, 60 * MB, 0.5) is None  # 2 layers would fit, 5 are required
    assert plan_placement(FP, CTX, 60 * MB, 0.2) is not None


def test_eviction_takes_the_lower_priority_first_then_the_cheaper_loss():
    clock = Clock()
    tm = manager(tier1=500 * MB, clock=clock)
    resident(tm, "busy-normal")
    resident(tm, "idle-normal")
    resident(tm, "low", "low")
    for _ in range(5):
        tm.lease("busy-normal", request=True)
        tm.release("busy-normal")
    tm.register("new", "normal", FP)
    order = [e.model_id for e in tm.evictable("new", (MemoryTier.TIER1,))]
    assert order == ["low", "idle-normal", "busy-normal"]
    promotion = tm.plan_promotion("new", CTX)
    assert [e.model for e in promotion.evictions] == ["low"]
    assert promotion.evictions[0].to_tier == MemoryTier.TIER2


def test_leased_pinned_and_higher_priority_models_are_never_evicted():
    tm = manager(tier1=320 * MB)
    resident(tm, "pinned", "realtime_pinned")
    resident(tm, "high", "high")
    tm.register("leased", "low", FP)
    tm.register("new", "normal", FP)
    assert tm.evictable("new", (MemoryTier.TIER1,)) == []
    with pytest.raises(NoRoom) as caught:
        tm.plan_promotion("new", CTX)
    assert caught.value.reason == "insufficient_vram_or_ram"


def test_a_leased_model_stays_and_the_newcomer_gets_507():
    tm = manager(tier1=200 * MB, min_gpu_layer_ratio=1.0)
    resident(tm, "serving")
    tm.lease("serving")
    tm.register("new", "normal", FP)
    with pytest.raises(NoRoom):
        tm.plan_promotion("new", CTX)
    tm.release("serving")
    assert [e.model for e in tm.plan_promotion("new", CTX).evictions] == ["serving"]


def test_victims_go_to_disk_when_the_warm_budget_is_full():
    tm = manager(tier1=200 * MB, tier2=100 * MB)
    resident(tm, "old")
    tm.register("new", "normal", FP)
    [eviction] = tm.plan_promotion("new", CTX).evictions
    assert eviction.to_tier == MemoryTier.TIER3  # 120 MB of weights do not fit 100 MB of tier 2


def test_warming_evicts_the_cheapest_warm_model_to_disk():
    tm = manager(tier2=250 * MB)
    for name in ("a", "b"):
        tm.register(name, "normal", FP)
        tm.commit(name, MemoryTier.TIER2)
    tm.register("c", "normal", FP)
    evictions = tm.plan_warm("c")
    assert [(e.model, e.to_tier) for e in evictions] == [("a", MemoryTier.TIER3)]


def test_the_request_rate_decays_over_about_ten_minutes():
    clock = Clock()
    rate = DecayingRate(clock)
    for _ in range(10):
        rate.tick()
    assert rate.per_minute() == pytest.approx(1.0)
    clock.now += 600
    assert rate.per_minute() == pytest.approx(1.0 / 2.718281828, rel=1e-3)


def test_the_status_counters_follow_the_ledger():
    tm = manager()
    resident(tm, "a")
    tm.register("b", "normal", FP)
    tm.commit("b", MemoryTier.TIER2)
    counters = tm.tier1_counters()
    assert counters["used"] == 160 * MB and counters["free"] == 40 * MB and counters["effective_free"] == 40 * MB
    assert tm.tier2_used() == 120 * MB
    status = tm.model_status("b")
    assert status["current_tier"] == "tier2_pinned_ram" and status["reload_estimate_ms"] > 0


def test_without_nvml_the_device_is_simulated():
    device = probe_device(limits(simulated_vram_bytes=123))
    caps = device.capabilities
    assert caps.simulated and caps.total_vram_bytes == 123 and caps.usable_vram_budget_bytes == 123
    assert caps.pinned_ram_budget_bytes == 1000 * MB
    assert device.real_vram() is None and device.gpu_health() is None


def smollm2_path() -> Path:
    config = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    return config.weights_file(config.models[0])


def test_the_gguf_reader_matches_what_llama_cpp_allocates():
    info = read_gguf(smollm2_path())
    assert info.architecture == "llama" and info.arch_int("block_count") == 30
    assert info.array_lengths["tokenizer.ggml.tokens"] == 49152
    fp = footprint_from_gguf(smollm2_path())
    # llama.cpp reports a 90.00 MiB KV buffer for 4096 cells and 92.10 MiB of mapped weights.
    assert fp.kv_bytes(4096) == 90 * 2**20
    assert abs(fp.weights_bytes - 92.10 * 2**20) < 0.01 * 2**20
    assert fp.trained_context_len == 8192
