"""The tier manager's core, table-tested with synthetic footprints (no engine, no Django)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypnos_site.config import BASE_DIR, load_config
from memory.device import Device, DeviceCapabilities, HardwareLimits, probe_device
from memory.gguf import GgufInfo, GgufTensor, _read_version, read_gguf
from memory.kv_park import KvParking, ParkedSlot, ParkedState
from memory.manager import DecayingRate, NoRoom, TierManager
from memory.planner import Footprint, footprint_from_gguf, footprint_from_info, plan_placement
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
    values = dict(
        simulated_vram_bytes=200 * MB,
        vram_reserve_bytes=0,
        pinned_ram_budget_bytes=1000 * MB,
        max_process_memory_bytes=None,
        min_gpu_layer_ratio=0.5,
    )
    values.update(overrides)
    return HardwareLimits(**values)  # type: ignore[arg-type]


def manager(tier1: int = 200 * MB, tier2: int = 1000 * MB, clock: Clock | None = None, **extra: object) -> TierManager:
    caps = DeviceCapabilities("Cpu", "None", "simulated", tier1, tier1, tier2, 8 << 30, True, 8 << 30)
    return TierManager(Device(caps), limits(**extra), clock=clock or Clock())


def resident(tm: TierManager, model: str, priority: str = "normal", fp: Footprint = FP) -> None:
    tm.register(model, priority, fp)
    tm.book_tier1(model, tm.plan_promotion(model, CTX).placement)


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


def test_held_by_leases_names_the_leased_models_only_when_their_room_would_do():
    tm = manager(tier1=200 * MB, min_gpu_layer_ratio=1.0)
    resident(tm, "serving")
    tm.register("new", "normal", FP)
    big = Footprint(layer_bytes=(40 * MB,) * 10, other_bytes=20 * MB, kv_bytes_per_token=1000, workspace_bytes=0)
    tm.register("too-big", "normal", big)
    assert tm.held_by_leases("new", CTX) == []  # idle: evicting it is the plan, no wait
    tm.lease("serving")
    assert tm.held_by_leases("new", CTX) == ["serving"]
    assert tm.held_by_leases("too-big", CTX) == []  # would not fit were it idle: the 507 stands
    assert tm.entries["serving"].tier == MemoryTier.TIER1 and tm.leases("serving") == 1  # only a question
    tm.release("serving")
    assert tm.held_by_leases("new", CTX) == []


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
        tm.book_tier2(name)
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
    tm.book_tier2("b")
    counters = tm.tier1_counters()
    assert counters["used"] == 160 * MB and counters["free"] == 40 * MB and counters["effective_free"] == 40 * MB
    assert tm.tier2_used() == 120 * MB
    status = tm.model_status("b")
    assert status["current_tier"] == "tier2_pinned_ram" and status["reload_estimate_ms"] > 0


def test_a_demotion_books_the_bytes_in_the_tier_it_goes_to():
    tm = manager()
    resident(tm, "a")
    tm.demote("a", MemoryTier.TIER2)
    assert tm.tier("a") == MemoryTier.TIER2 and tm.tier1_used() == 0 and tm.tier2_used() == 120 * MB
    tm.demote("a", MemoryTier.TIER3)
    assert tm.tier("a") == MemoryTier.TIER3 and tm.tier2_used() == 0
    assert tm.placement("a").primary_tier == MemoryTier.TIER3


def test_a_failed_load_leaves_tier_1_through_the_demotion():
    tm = manager()
    resident(tm, "warm")
    resident(
        tm, "cold", fp=Footprint(layer_bytes=(1 * MB,) * 10, other_bytes=0, kv_bytes_per_token=0, workspace_bytes=0)
    )
    tm.load_failed("warm", weights_warm=True)
    tm.load_failed("cold", weights_warm=False)
    assert (tm.tier("warm"), tm.tier("cold")) == (MemoryTier.TIER2, MemoryTier.TIER3)
    assert tm.tier1_used() == 0


def test_warming_never_takes_a_model_out_of_tier_1():
    tm = manager()
    resident(tm, "a")
    with pytest.raises(ValueError, match="demote"):
        tm.book_tier2("a")
    with pytest.raises(ValueError, match="book_tier1"):
        tm.demote("a", MemoryTier.TIER1)
    assert tm.tier("a") == MemoryTier.TIER1


def test_a_failed_warm_puts_the_model_back_on_disk():
    tm = manager()
    tm.register("a", "normal", FP)
    tm.book_tier2("a")
    tm.warm_failed("a")
    assert tm.tier("a") == MemoryTier.TIER3 and tm.tier2_used() == 0


def test_a_resident_model_cannot_be_forgotten_before_its_demotion():
    tm = manager()
    resident(tm, "a")
    with pytest.raises(ValueError, match="demote"):
        tm.forget("a")
    tm.demote("a", MemoryTier.TIER3)
    tm.forget("a")
    assert "a" not in tm and tm.placement("a").primary_tier == MemoryTier.TIER3


def test_a_move_lease_is_refused_while_the_model_serves():
    tm = manager()
    tm.register("a", "normal", FP)
    tm.lease("a")
    assert tm.lease_if_idle("a") is False and tm.leases("a") == 1
    tm.release("a")
    assert tm.lease_if_idle("a") is True and tm.leases("a") == 1
    assert tm.model_status("a")["requests_per_minute"] > 0  # the request counted, the move did not
    tm.release("a", served=False)
    assert tm.model_status("a")["total_requests_served"] == 1


def test_max_loaded_models_applies_from_the_next_promotion():
    tm = manager(tier1=1000 * MB)
    resident(tm, "a")
    tm.register("b", "normal", FP)
    assert tm.plan_promotion("b", CTX).evictions == []
    tm.set_max_resident(1)
    [eviction] = tm.plan_promotion("b", CTX).evictions
    assert (eviction.model, eviction.reason) == ("a", "max_loaded_models")


def test_the_reload_estimate_is_none_in_tier_1_and_counted_from_the_current_tier():
    tm = manager()
    resident(tm, "a")
    assert tm.reload_estimate_ms("a") is None and tm.reload_estimate_ms("unknown") is None
    tm.demote("a", MemoryTier.TIER2)
    warm = tm.reload_estimate_ms("a")
    tm.demote("a", MemoryTier.TIER3)
    assert warm is not None and 0 < warm < (tm.reload_estimate_ms("a") or 0)


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


# MoE offload: 10 layers of 10 MB, 8 MB of each being routed experts (80 MB of experts).
MOE = Footprint(
    layer_bytes=(10 * MB,) * 10,
    other_bytes=20 * MB,
    kv_bytes_per_token=1000,
    workspace_bytes=30 * MB,
    layer_expert_bytes=(8 * MB,) * 10,
)


def test_moe_offload_auto_moves_the_experts_of_as_few_layers_as_needed_before_any_split():
    # Whole it needs 160 MB; 8 MB of experts per layer to host memory: 3 layers for 140 MB.
    plan = plan_placement(MOE, CTX, 140 * MB, 0.5, "auto")
    assert plan is not None and (plan.gpu_layers, plan.pinned_ram_layers, plan.cpu_expert_layers) == (10, 0, 3)
    assert plan.vram_weight_bytes == 120 * MB - 24 * MB and plan.pinned_ram_bytes == 24 * MB
    assert plan.vram_kv_and_workspace_bytes == 40 * MB  # the KV stays on the GPU
    # With the mode off the same budget splits the layers instead.
    off = plan_placement(MOE, CTX, 140 * MB, 0.5, "off")
    assert off is not None and off.gpu_layers < 10 and off.cpu_expert_layers == 0


def test_moe_offload_auto_changes_nothing_when_the_model_fits_whole():
    plan = plan_placement(MOE, CTX, 160 * MB, 0.5, "auto")
    assert plan is not None and plan.cpu_expert_layers == 0 and plan.pinned_ram_bytes == 0


def test_moe_offload_on_keeps_every_layers_experts_in_host_memory():
    plan = plan_placement(MOE, CTX, 1000 * MB, 0.5, "on")
    assert plan is not None and (plan.gpu_layers, plan.cpu_expert_layers) == (10, 10)
    assert plan.vram_weight_bytes == 40 * MB and plan.pinned_ram_bytes == 80 * MB


def test_moe_offload_auto_splits_layers_with_every_expert_offloaded_when_even_that_does_not_fit():
    # All experts out: 40 MB weights + 40 MB KV/workspace = 80 MB; 70 MB needs a split. Without
    # the experts a layer is 2 MB + 1 MB of KV: k layers cost 3k + 30 MB -> k = 9 (with 20 MB of
    # other tensors then in host memory as well).
    plan = plan_placement(MOE, CTX, 70 * MB, 0.5, "auto")
    assert plan is not None and (plan.gpu_layers, plan.pinned_ram_layers, plan.cpu_expert_layers) == (9, 1, 10)
    assert plan.vram_weight_bytes == 9 * 2 * MB
    assert plan.pinned_ram_bytes == 120 * MB - 18 * MB + 1 * MB
    # With experts following their layer the same budget is below the minimum layer ratio.
    assert plan_placement(MOE, CTX, 70 * MB, 0.5, "off") is None


def test_a_dense_model_ignores_the_moe_offload_mode():
    assert FP.expert_bytes == 0
    for mode in ("off", "auto", "on"):
        assert plan_placement(FP, CTX, 160 * MB, 0.5, mode) == plan_placement(FP, CTX, 160 * MB, 0.5, "off")
        tight = plan_placement(FP, CTX, 100 * MB, 0.5, mode)
        assert tight is not None and (tight.gpu_layers, tight.cpu_expert_layers) == (6, 0)


def test_the_manager_evicts_an_idle_model_before_offloading_experts_and_offloads_before_splitting():
    tm = manager(tier1=300 * MB)
    resident(tm, "idle")  # 160 MB
    tm.register("moe", "normal", MOE, moe_offload="auto")
    # 140 MB free: the whole model (160 MB) fits only by evicting; offloading 3 layers' experts
    # would need no eviction, but a whole placement with its experts on the GPU comes first.
    promotion = tm.plan_promotion("moe", CTX)
    assert promotion.placement.cpu_expert_layers == 0 and [e.model for e in promotion.evictions] == ["idle"]
    tm.lease("idle")  # now the idle model cannot go: the experts of 3 layers move instead
    promotion = tm.plan_promotion("moe", CTX)
    assert promotion.evictions == [] and promotion.placement.cpu_expert_layers == 3
    assert promotion.placement.gpu_layers == 10
    status = tm.model_status("moe")
    assert status["moe_offload"] == "auto" and status["expert_bytes"] == 80 * MB


def test_the_moe_offload_mode_can_change_between_placements():
    tm = manager(tier1=1000 * MB)
    tm.register("moe", "normal", MOE)
    assert tm.plan_promotion("moe", CTX).placement.cpu_expert_layers == 0
    tm.set_moe_offload("moe", "on")
    placement = tm.plan_promotion("moe", CTX).placement
    assert placement.cpu_expert_layers == 10 and placement.pinned_ram_bytes == 80 * MB


def test_the_gguf_reader_finds_the_expert_tensors_of_each_layer():
    info = GgufInfo(
        {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2},
        tensors=[
            GgufTensor("token_embd.weight", 100),
            GgufTensor("blk.0.attn_q.weight", 10),
            GgufTensor("blk.0.ffn_gate_inp.weight", 3),
            GgufTensor("blk.0.ffn_up_exps.weight", 40),
            GgufTensor("blk.0.ffn_down_exps.weight", 40),
            GgufTensor("blk.0.ffn_gate_exps.weight", 40),
            GgufTensor("blk.0.ffn_up_shexp.weight", 7),
            GgufTensor("blk.1.attn_q.weight", 10),
            GgufTensor("blk.1.ffn_gate_up_exps.weight", 80),
        ],
    )
    fp = footprint_from_info(info)
    assert fp.layer_expert_bytes == (120, 80) and fp.expert_bytes == 200
    assert fp.layer_bytes == (140, 90) and fp.other_bytes == 100


def test_a_dense_gguf_has_no_expert_bytes():
    fp = footprint_from_gguf(smollm2_path())
    assert fp.layer_expert_bytes == () and fp.expert_bytes == 0


def parked(clock: Clock, *used_ago: float) -> ParkedState:
    slots = tuple(ParkedSlot(seq, (1, 2, 3), b"x" * 100, clock.now - ago) for seq, ago in enumerate(used_ago))
    return ParkedState(layout=("ctx",), slots=slots, parked_at=clock.now)


def test_parked_slots_idle_past_the_kv_idle_timeout_are_dropped():
    clock = Clock()
    parking = KvParking(True, 10_000, idle_timeout_secs=60, clock=clock)
    assert parking.park("m", parked(clock, 10, 50))
    [row] = parking.status()["models"]
    assert (row["slots"], row["tokens"], row["bytes"]) == (2, 6, 200)
    clock.now += 20  # the slot served 50 s before parking is now 70 s idle
    [row] = parking.status()["models"]
    assert (row["slots"], row["bytes"]) == (1, 100) and parking.status()["used_bytes"] == 100
    clock.now += 40
    assert parking.status()["models"] == [] and parking.take("m", ("ctx",)) is None


def test_a_state_whose_slots_are_all_idle_too_long_is_not_parked():
    clock = Clock()
    parking = KvParking(True, 10_000, idle_timeout_secs=60, clock=clock)
    assert not parking.park("m", parked(clock, 61))
    assert parking.status()["models"] == []


def test_without_an_idle_timeout_a_parked_state_is_kept_until_taken():
    clock = Clock()
    parking = KvParking(True, 10_000, clock=clock)
    parking.park("m", parked(clock, 10_000, 0))
    clock.now += 86_400
    state = parking.take("m", ("ctx",))
    assert state is not None and [s.seq for s in state.slots] == [0, 1]
    assert parking.take("m", ("ctx",)) is None


def test_parked_states_written_by_a_stopping_worker_are_taken_back_by_the_next(tmp_path):
    clock = Clock()
    before = KvParking(True, 10_000, idle_timeout_secs=60, clock=clock)
    before.park("org/model:q4", parked(clock, 10, 50))
    before.park("other", ParkedState(("ctx", 2), (ParkedSlot(3, (9,), b"\x00\xff" * 8, clock.now),), clock.now))
    assert before.save(tmp_path) == 2 and len(list(tmp_path.iterdir())) == 2

    # Another process, another monotonic clock: the ages come across by the wall clock.
    later = Clock()
    later.now = 5.0
    after = KvParking(True, 10_000, idle_timeout_secs=60, clock=later)
    assert after.load(tmp_path) == 2 and list(tmp_path.iterdir()) == []
    rows = {r["model"]: r for r in after.status()["models"]}
    assert (rows["org/model:q4"]["slots"], rows["org/model:q4"]["bytes"]) == (2, 200)
    later.now += 20  # the slot served 50 s before the stop is now 70 s idle
    state = after.take("org/model:q4", ("ctx",))
    assert state is not None and [(s.seq, s.tokens) for s in state.slots] == [(0, (1, 2, 3))]
    [slot] = after.take("other", ("ctx", 2)).slots  # type: ignore[union-attr]
    assert (slot.seq, slot.tokens, slot.data) == (3, (9,), b"\x00\xff" * 8)


def test_parked_states_that_do_not_read_back_are_dropped(tmp_path):
    clock = Clock()
    before = KvParking(True, 10_000, clock=clock)
    before.park("m", parked(clock, 0))
    before.save(tmp_path)
    [path] = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:-1])  # cut short
    (tmp_path / "junk.kvpark").write_bytes(b"\x00" * 40)
    after = KvParking(True, 10_000, clock=clock)
    assert after.load(tmp_path) == 0 and list(tmp_path.iterdir()) == []
    assert after.status()["models"] == []
    # Parking off: nothing is taken, the files go all the same; a missing folder is no error.
    before.save(tmp_path)
    assert KvParking(False, 10_000).load(tmp_path) == 0 and list(tmp_path.iterdir()) == []
    assert KvParking(True, 10_000).load(tmp_path / "absent") == 0


def test_idle_unload_is_due_after_the_keep_alive_counted_from_the_last_use():
    clock = Clock()
    tm = manager(clock=clock)
    resident(tm, "a")
    resident(tm, "b")
    tm.set_keep_alive("a", 60)
    tm.set_keep_alive("b", -1)  # forever
    tm.lease("a")
    clock.now += 100
    assert tm.expired() == [] and tm.expires_at("a") is None  # serving: never due
    tm.release("a")
    clock.now += 59
    assert tm.expired() == [] and tm.expires_at("a") is not None
    assert tm.model_status("a")["keep_alive_secs"] == 60 and tm.model_status("b")["expires_at"] is None
    clock.now += 1
    assert tm.expired() == ["a"]
    assert tm.model_status("b")["keep_alive_secs"] == -1
    tm.demote("a", MemoryTier.TIER2)
    assert tm.expired() == [] and tm.expires_at("a") is None  # only tier 1 is unloaded


def test_the_warm_budget_decides_where_an_idle_model_goes():
    tm = manager(tier2=100 * MB)  # less than the 120 MB of weights
    resident(tm, "a")
    assert tm.warm_room_for("a") is False
    roomy = manager()
    resident(roomy, "a")
    assert roomy.warm_room_for("a") is True


def test_a_keep_alive_beyond_any_date_is_forever():
    tm = manager()
    resident(tm, "a")
    for secs in (1e300, float("inf"), float("nan"), 1e10):
        tm.set_keep_alive("a", secs)
        assert tm.model_status("a")["keep_alive_secs"] == -1 and tm.expires_at("a") is None
    tm.set_keep_alive("a", 9e9)
    assert tm.expires_at("a") is not None


def test_a_whole_placement_offloads_every_layer_and_the_output_head():
    """llama.cpp offloads the output head first and counts it as a layer: n_gpu_layers equal to
    the model's layer count would leave layer 0 in host memory (issue 20's GPU check found it)."""
    from inference.engines.llama import llama_gpu_layers

    assert llama_gpu_layers(24, 24) == -1
    assert llama_gpu_layers(30, 24) == -1
    assert llama_gpu_layers(10, 24) == 10  # partial: as planned
    assert llama_gpu_layers(0, 24) == 0  # tier 1 simulated, or no GPU


def _tiny_gguf(path: Path, context_length: int, vocab: int) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(context_length)
    writer.add_token_list([f"token-{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", np.zeros((vocab, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_header_is_read_once_per_version_of_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, 1024, 300)
    first = read_gguf(path)
    assert first.arch_int("context_length") == 1024
    assert first.array_lengths["tokenizer.ggml.tokens"] == 300
    assert first.tensors == [GgufTensor("token_embd.weight", 300 * 8 * 4)]
    # Each caller gets its own containers: changing one copy changes no later read, which comes
    # from the cache, not the file.
    first.metadata["llama.context_length"] = 7
    first.tensors.clear()
    hits = _read_version.cache_info().hits
    again = read_gguf(path)
    assert _read_version.cache_info().hits == hits + 1
    assert again.arch_int("context_length") == 1024 and len(again.tensors) == 1
    # A rewritten file (another size, another mtime) is read again, not served from the cache.
    _tiny_gguf(path, 4096, 500)
    rewritten = read_gguf(path)
    assert rewritten.arch_int("context_length") == 4096
    assert rewritten.array_lengths["tokenizer.ggml.tokens"] == 500
    # A symlink to it reads the same version.
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    assert read_gguf(link) == rewritten
