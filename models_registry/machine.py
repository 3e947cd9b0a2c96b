"""The machine the advisor plans for and the tier budgets the server would derive on it."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Any

from hypnos_site.config import HardwareConfig
from memory.device import HardwareLimits, probe_device, warm_ram_budget

GIB = 1 << 30
UNIFIED_OS_RESERVE = 4 * GIB
# Metal's default recommendedMaxWorkingSetSize: about two thirds of the memory up to 36 GiB,
# three quarters above.
METAL_SMALL_MACHINE = 36 * GIB


@dataclass(frozen=True)
class Machine:
    vram_bytes: int
    ram_bytes: int
    unified_memory: bool

    @property
    def platform(self) -> str:
        """The catalog's files[].platform this machine takes."""
        return "macos-arm64" if self.unified_memory else "other"

    def describe(self) -> str:
        if self.unified_memory:
            return f"{gib(self.ram_bytes)} of unified memory"
        gpu = f"{gib(self.vram_bytes)} VRAM" if self.vram_bytes else "no GPU"
        return f"{gpu}, {gib(self.ram_bytes)} RAM"


@dataclass(frozen=True)
class Budgets:
    tier1_bytes: int
    tier2_bytes: int
    unified_memory: bool
    # False: no GPU, tier 1 is host memory (the server's simulated device).
    gpu: bool

    def as_dict(self) -> dict[str, Any]:
        return {"tier1_bytes": self.tier1_bytes, "tier2_bytes": self.tier2_bytes, "unified_memory": self.unified_memory}


def derive_budgets(machine: Machine, hardware: HardwareConfig) -> Budgets:
    """The tier budgets the server would have on `machine` with these [hardware] settings."""
    ram = machine.ram_bytes
    if machine.unified_memory:
        usable = max(ram - UNIFIED_OS_RESERVE, 0)
        working_set = ram * 2 // 3 if ram <= METAL_SMALL_MACHINE else ram * 3 // 4
        tier1 = min(working_set, usable)
        return Budgets(tier1, min(ram // 2, usable - tier1), unified_memory=True, gpu=True)
    tier2 = warm_ram_budget(HardwareLimits.of(hardware), ram)
    if machine.vram_bytes:
        return Budgets(max(machine.vram_bytes - hardware.vram_reserve_bytes, 0), tier2, unified_memory=False, gpu=True)
    # Without a GPU tier 1 is simulated_vram_bytes of host memory, beside the warm budget.
    return Budgets(min(hardware.simulated_vram_bytes, ram - tier2), tier2, unified_memory=False, gpu=False)


def this_machine(hardware: HardwareConfig) -> Machine:
    """The machine this server runs on: its GPU as NVML reports it (none: 0), its memory."""
    caps = probe_device(HardwareLimits.of(hardware)).capabilities
    unified = sys.platform == "darwin" and platform.machine() == "arm64"
    vram = 0 if caps.simulated or unified else caps.total_vram_bytes
    return Machine(vram_bytes=vram, ram_bytes=caps.installed_memory_bytes, unified_memory=unified)


def resolve_machine(
    vram_bytes: int | None, ram_bytes: int | None, unified_memory: bool | None, hardware: HardwareConfig
) -> Machine:
    """The machine the request describes; what it leaves out is this server's (unified memory
    only when vram_bytes is not given either). On unified memory vram_bytes is ignored."""
    probed: list[Machine] = []

    def here() -> Machine:
        if not probed:
            probed.append(this_machine(hardware))
        return probed[0]

    if unified_memory is None:
        unified_memory = False if vram_bytes is not None else here().unified_memory
    vram = 0 if unified_memory else vram_bytes if vram_bytes is not None else here().vram_bytes
    ram = ram_bytes if ram_bytes is not None else here().ram_bytes
    return Machine(vram_bytes=vram, ram_bytes=ram, unified_memory=unified_memory)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"
