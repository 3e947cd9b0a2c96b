"""NVML's budgets, as memory/device.py reads them, against nvidia-smi's own figures."""

from __future__ import annotations

from typing import Any

from bench.gpu.probe import query_smi
from tests.gpu.conftest import MIB, limits

# nvidia-smi and NVML are read a moment apart; on an idle device free memory moves by less.
FREE_TOLERANCE = 64 * MIB


def test_the_nvml_budgets_match_nvidia_smi(figures: dict[str, Any]) -> None:
    from memory.device import probe_device

    reserve = 512 * MIB
    device = probe_device(limits(vram_reserve_bytes=reserve))
    [smi, *_] = query_smi()
    real = device.real_vram()
    assert real is not None and not device.simulated
    free, total = real
    caps = device.capabilities
    figures.update(
        nvml_total=total, nvml_free=free, smi_total_mib=smi.total_mib, smi_free_mib=smi.free_mib, name=caps.device_name
    )
    assert caps.accelerator == "NvidiaCuda" and caps.device_name == smi.name
    assert abs(caps.total_vram_bytes - smi.total_mib * MIB) < MIB
    assert caps.usable_vram_budget_bytes == caps.total_vram_bytes - reserve
    assert abs(free - smi.free_mib * MIB) <= FREE_TOLERANCE
    health = device.gpu_health()
    assert health is not None and health["temperature_celsius"] is not None
