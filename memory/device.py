"""The device the tiers live on: an NVIDIA GPU seen through NVML, or a simulated one.

Without a GPU (or without the NVML library) tier 1 is a budget of `simulated_vram_bytes` booked
in host memory, `simulated: true` in the capabilities; every tier behaviour stays testable.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import psutil

log = logging.getLogger(__name__)
GPU_SAMPLE_SECS = 3.0


@dataclass(frozen=True)
class DeviceCapabilities:
    accelerator: str
    topology: str
    device_name: str
    total_vram_bytes: int
    usable_vram_budget_bytes: int
    pinned_ram_budget_bytes: int
    physical_memory_bytes: int
    simulated: bool
    installed_memory_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareLimits:
    """The `[hardware]` values the device needs (kept apart so memory/ stays config-agnostic)."""

    simulated_vram_bytes: int
    vram_reserve_bytes: int
    pinned_ram_budget_bytes: int | None
    max_process_memory_bytes: int | None
    min_gpu_layer_ratio: float

    @classmethod
    def of(cls, hardware: Any) -> HardwareLimits:
        """The limits of a config's [hardware] section (any object with these attributes)."""
        return cls(**{f.name: getattr(hardware, f.name) for f in fields(cls)})


class Device:
    """Capabilities plus live readings (real free VRAM, GPU health) where a GPU exists."""

    def __init__(self, capabilities: DeviceCapabilities, nvml_handle: Any = None):
        self.capabilities = capabilities
        self._handle = nvml_handle
        self._gpu_sample: dict[str, Any] | None = None
        self._sampled_at = 0.0
        self._lock = threading.Lock()

    @property
    def simulated(self) -> bool:
        return self.capabilities.simulated

    def real_vram(self) -> tuple[int, int] | None:
        """(free, total) bytes as the device reports them; None on a simulated device."""
        if self._handle is None:
            return None
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.free), int(info.total)

    def gpu_health(self) -> dict[str, Any] | None:
        """Utilization, temperature, power, clocks; sampled at most every few seconds."""
        if self._handle is None:
            return None
        with self._lock:
            if self._gpu_sample is None or time.monotonic() - self._sampled_at > GPU_SAMPLE_SECS:
                self._gpu_sample = _sample_gpu(self._handle)
                self._sampled_at = time.monotonic()
            return dict(self._gpu_sample)


def _sample_gpu(handle: Any) -> dict[str, Any]:
    import pynvml

    def read(fn: Any, *args: Any) -> Any:
        try:
            return fn(handle, *args)
        except pynvml.NVMLError:
            return None

    throttle = read(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    power = read(pynvml.nvmlDeviceGetPowerUsage)
    util = read(pynvml.nvmlDeviceGetUtilizationRates)
    ecc = read(pynvml.nvmlDeviceGetTotalEccErrors, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    return {
        "utilization_percent": util.gpu if util is not None else None,
        "temperature_celsius": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "power_watts": round(power / 1000, 1) if power is not None else None,
        "sm_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "throttle_reasons": throttle,
        "throttled": bool(throttle and throttle & ~pynvml.nvmlClocksThrottleReasonGpuIdle),
        "ecc_uncorrected_errors": ecc,
        "sampled_unix_ms": int(time.time() * 1000),
    }


def warm_ram_budget(limits: HardwareLimits, installed: int) -> int:
    return limits.pinned_ram_budget_bytes if limits.pinned_ram_budget_bytes is not None else installed // 2


def probe_device(limits: HardwareLimits) -> Device:
    """The first NVIDIA GPU through NVML, else a simulated device."""
    installed = psutil.virtual_memory().total
    tier2 = warm_ram_budget(limits, installed)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception as exc:  # no library, no driver or no device: all mean "no GPU here"
        log.info("no NVIDIA GPU (%s); tier 1 is simulated with %d bytes", exc, limits.simulated_vram_bytes)
        return Device(
            DeviceCapabilities(
                accelerator="Cpu",
                topology="None",
                device_name="simulated",
                total_vram_bytes=limits.simulated_vram_bytes,
                usable_vram_budget_bytes=limits.simulated_vram_bytes,
                pinned_ram_budget_bytes=tier2,
                physical_memory_bytes=installed,
                simulated=True,
                installed_memory_bytes=installed,
            )
        )
    return Device(
        DeviceCapabilities(
            accelerator="NvidiaCuda",
            topology="DiscretePcie",
            device_name=name if isinstance(name, str) else name.decode(),
            total_vram_bytes=total,
            usable_vram_budget_bytes=max(total - limits.vram_reserve_bytes, 0),
            pinned_ram_budget_bytes=tier2,
            physical_memory_bytes=installed,
            simulated=False,
            installed_memory_bytes=installed,
        ),
        nvml_handle=handle,
    )


def process_memory_bytes() -> int:
    """Resident memory of this process (what a process-memory cap is measured against)."""
    return int(psutil.Process().memory_info().rss)
