"""The GPU test set (issue 20): Hypnos's CUDA paths against a real NVIDIA GPU.

Left out of the suite's own collection unless HYPNOS_GPU_TESTS=1 (tests/conftest.py), which
`./run.sh gpu-check` sets; where NVML sees no device every test here skips with that reason. The model is the GGUF named
by HYPNOS_GPU_MODEL (the check generates one of ~1 GiB), else one generated here. Measured
figures go to the JSON-lines file HYPNOS_GPU_FIGURES (the check merges them into its report).

Heavy imports (llama_cpp, the engines) happen inside fixtures: collecting these tests on a
machine without them must still report every test as skipped with its reason.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.gpu.probe import nvml_device

HERE = Path(__file__).parent
CONTEXT = 4096
MIB = 2**20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if HERE in Path(str(item.fspath)).parents]
    if not gpu_items:
        return
    device, why = nvml_device()
    if device is None:
        skip = pytest.mark.skip(reason=f"GPU test: {why}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("HYPNOS_GPU_MODEL")
    if named:
        return Path(named)
    from bench.gpu.model import shape_for, write_model

    return write_model(tmp_path_factory.mktemp("gpu") / "gpu-check.gguf", shape_for(1024))


@pytest.fixture(scope="session")
def cuda_llama() -> Any:
    """llama_cpp, when it is a GPU build (else the test skips with the reason)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if not llama_cpp.llama_supports_gpu_offload():
        pytest.skip(f"llama_cpp at {llama_cpp.__file__} is a CPU build (no GPU offload)")
    return llama_cpp


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """What the test measured; written out whether it passes or fails."""
    found: dict[str, Any] = {}
    yield found
    sink = os.environ.get("HYPNOS_GPU_FIGURES")
    if sink and found:
        with open(sink, "a") as out:
            out.write(json.dumps({"test": request.node.name, "figures": found}, default=str) + "\n")


def nvml_used() -> int:
    """Bytes in use on GPU 0, as NVML reports them (every process, the driver's reserve too)."""
    import pynvml

    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    return int(info.total) - int(info.free)


class LlamaLog:
    """llama.cpp's log lines during a block (`with LlamaLog(llama_cpp) as log:`): what it put
    where is read from its own words, not inferred."""

    def __init__(self, llama_cpp: Any):
        self.llama_cpp = llama_cpp
        self.lines: list[str] = []

        @llama_cpp.llama_log_callback
        def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            self.lines.append(text.decode(errors="replace"))

        self._callback = capture

    def __enter__(self) -> LlamaLog:
        self.llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc: object) -> None:
        self.llama_cpp.llama_log_set(self.llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def repeating_layers_on_gpu(self) -> int | None:
        found = re.search(r"offloading (\d+) repeating layers to GPU", self.text)
        return int(found.group(1)) if found else None

    def output_on_gpu(self) -> bool:
        return "offloading output layer to GPU" in self.text

    def buffers(self) -> dict[str, float]:
        """MiB per buffer llama.cpp reports ("CUDA0 model", "CPU_Mapped model", "CUDA0 KV",
        "CUDA0 compute", ...), summed over repeats."""
        found: dict[str, float] = {}
        for where, kind, mib in re.findall(
            r"(\S+)\s+(model|KV|compute|RS|output) buffer size =\s*([\d.]+) MiB", self.text
        ):
            found[f"{where} {kind}"] = found.get(f"{where} {kind}", 0.0) + float(mib)
        return found

    def cuda_bytes(self) -> int:
        """The bytes llama.cpp says it allocated on CUDA devices (model, KV, compute, output);
        CUDA_Host buffers are pinned host memory, not the device's."""
        on_device = [mib for name, mib in self.buffers().items() if re.match(r"CUDA\d", name)]
        return int(sum(on_device) * MIB)


def limits(vram_reserve_bytes: int = 512 * MIB) -> Any:
    from memory.device import HardwareLimits

    return HardwareLimits(
        simulated_vram_bytes=0,
        vram_reserve_bytes=vram_reserve_bytes,
        pinned_ram_budget_bytes=None,
        max_process_memory_bytes=None,
        min_gpu_layer_ratio=0.1,
    )


@pytest.fixture
def engine(cuda_llama: Any, gpu_model: Path) -> Iterator[Any]:
    """The project's llama engine for the test model, cooled (VRAM and warm copy released) after."""
    from hypnos_site.config import ModelConfig
    from inference.engines.llama import LlamaEngine

    config = ModelConfig(
        id="gpu-check",
        modality="text_generation",
        engine="ggml_llama",
        weights_path=str(gpu_model),
        context_len=CONTEXT,
    )
    engine = LlamaEngine(config, gpu_model, os.cpu_count())
    yield engine
    engine.cool()


@pytest.fixture(scope="session")
def cuda_context(cuda_llama: Any, gpu_model: Path) -> int:
    """The first CUDA load of the process creates the CUDA context and cuBLAS handles, which
    are no model's bytes: one load and unload before any test measures; NVML's used bytes after."""
    llm = cuda_llama.Llama(model_path=str(gpu_model), n_ctx=256, n_gpu_layers=1, verbose=False)
    llm.create_completion("a", max_tokens=1)
    llm.close()
    return nvml_used()
