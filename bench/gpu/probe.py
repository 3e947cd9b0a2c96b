"""What GPU this machine has, as nvidia-smi and NVML see it."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

SMI_FIELDS = ("name", "compute_cap", "memory.total", "memory.used", "memory.free", "driver_version")


@dataclass(frozen=True)
class SmiGpu:
    """One GPU line of `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`;
    memory figures in MiB, as nvidia-smi gives them."""

    name: str
    compute_cap: str
    total_mib: int
    used_mib: int
    free_mib: int
    driver: str

    @property
    def cuda_arch(self) -> str:
        return cuda_arch(self.compute_cap)


def cuda_arch(compute_cap: str) -> str:
    """CMAKE_CUDA_ARCHITECTURES for a compute capability as nvidia-smi prints it: "9.0" -> "90",
    "12.0" -> "120"."""
    major, _, minor = compute_cap.strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        raise ValueError(f"not a compute capability: {compute_cap!r}")
    return f"{int(major)}{int(minor or 0)}"


def parse_smi(text: str) -> list[SmiGpu]:
    """The GPUs of nvidia-smi's CSV answer (one line each, fields in SMI_FIELDS order)."""
    gpus = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(SMI_FIELDS):
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        name, cap, total, used, free, driver = values
        gpus.append(SmiGpu(name, cap, int(float(total)), int(float(used)), int(float(free)), driver))
    return gpus


def query_smi() -> list[SmiGpu]:
    """The GPUs nvidia-smi lists; empty when there is no nvidia-smi or it sees none."""
    if shutil.which("nvidia-smi") is None:
        return []
    fields = ",".join(SMI_FIELDS)
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return parse_smi(done.stdout) if done.returncode == 0 and done.stdout.strip() else []


def nvml_device() -> tuple[dict[str, object] | None, str]:
    """(NVML's view of GPU 0, "") where NVML sees a device, else (None, why not)."""
    try:
        import pynvml
    except ImportError as exc:
        return None, f"no NVML bindings (pynvml): {exc}"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception as exc:  # no driver, no device: NVMLError subclasses, or OSError for the library
        return None, f"NVML sees no GPU: {exc}"
    return {
        "name": name if isinstance(name, str) else name.decode(),
        "total_bytes": int(memory.total),
        "free_bytes": int(memory.free),
        "used_bytes": int(memory.used),
    }, ""
