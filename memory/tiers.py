"""Tiers and placements, the vocabulary of spec §5 and §18."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum


class MemoryTier(StrEnum):
    TIER1 = "tier1_gpu_vram"
    TIER2 = "tier2_pinned_ram"
    TIER3 = "tier3_nvme_ssd"


@dataclass(frozen=True)
class Placement:
    """The spec's LayerPlacementPlan: where a model's layers and bytes live."""

    primary_tier: MemoryTier
    gpu_layers: int = 0
    pinned_ram_layers: int = 0
    ssd_layers: int = 0
    vram_weight_bytes: int = 0
    vram_kv_and_workspace_bytes: int = 0
    pinned_ram_bytes: int = 0
    allocated_context_len: int = 0
    cpu_expert_layers: int = 0

    @classmethod
    def on_disk(cls, n_layers: int) -> Placement:
        return cls(primary_tier=MemoryTier.TIER3, ssd_layers=n_layers)

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["primary_tier"] = str(self.primary_tier)
        return data
