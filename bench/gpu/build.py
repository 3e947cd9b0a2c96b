"""llama-cpp-python with CUDA for one GPU architecture, and llama.cpp's `llama-server` from the
same vendored tree and the same CMake build directory.

The device machine is offline: the sdist's build requirements (scikit-build-core, cmake, ninja)
are on its python3 already, so pip runs with --no-build-isolation --no-index. The build directory
is kept (scikit-build-core's `build-dir`) so that `llama-server` is one reconfigure and one target
away, reusing every compiled ggml-cuda object instead of compiling them a second time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SERVER_ARGS = [
    "-DLLAMA_BUILD_TOOLS=ON",
    # With the tools on, llama.cpp adds tools/mtmd itself; llama-cpp-python's own
    # add_subdirectory of it (LLAVA_BUILD) would claim the same build folder twice.
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    # No web UI: it would need npm or a download; the benchmark uses the HTTP API only.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]


def cuda_cmake_args(base: str, arch: str) -> str:
    """The project's llama.cpp flags (run.sh LLAMA_CMAKE_ARGS) with CUDA for `arch` only."""
    args = [a for a in base.split() if not a.startswith(("-DGGML_CUDA=", "-DCMAKE_CUDA_ARCHITECTURES="))]
    return " ".join([*args, "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"])


def find_cublas() -> tuple[list[str], list[str]]:
    """(extra CMake flags, library folders for LD_LIBRARY_PATH) that give ggml-cuda cuBLAS.

    A toolkit with cuBLAS needs nothing. An nvcc-only toolkit (such a one is on these machines)
    has no cublas_v2.h; then the cuBLAS of the pip `nvidia-cublas` package torch brings is used:
    its headers by -I, its versioned libraries named to FindCUDAToolkit (it finds no
    unversioned libcublas.so there), its folder on the library path at run time."""
    nvcc = shutil.which("nvcc")
    toolkit = Path(os.path.realpath(nvcc)).parent.parent if nvcc else Path("/usr/local/cuda")
    libs = [str(d) for d in (toolkit / "lib64", toolkit / "targets" / "x86_64-linux" / "lib") if d.is_dir()]
    if any(
        (d / "cublas_v2.h").exists() for d in (toolkit / "include", toolkit / "targets" / "x86_64-linux" / "include")
    ):
        return [], libs
    for site in map(Path, sys.path):
        for header in sorted(site.glob("nvidia/**/include/cublas_v2.h")):
            lib = header.parent.parent / "lib"
            cublas, cublas_lt = sorted(lib.glob("libcublas.so.*")), sorted(lib.glob("libcublasLt.so.*"))
            if cublas and cublas_lt:
                flags = [
                    f"-DCUDA_cublas_LIBRARY={cublas[0]}",
                    f"-DCUDA_cublasLt_LIBRARY={cublas_lt[0]}",
                    f"-DCMAKE_CUDA_FLAGS=-I{header.parent}",
                    f"-DCMAKE_CXX_FLAGS=-I{header.parent}",
                ]
                return flags, [*libs, str(lib)]
    return [], libs


def extract_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist into `dest`; its top folder."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
        top = tar.getnames()[0].split("/")[0]
    return dest / top


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> float:
    """Run `cmd` with its output appended to `log`; the seconds it took. CalledProcessError or
    TimeoutExpired (the process killed) when it fails or runs past `timeout`."""
    started = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout, env=env)
    return time.monotonic() - started


def build_wheel(source: Path, build_dir: Path, wheel_dir: Path, cmake_args: str, log: Path, timeout: float) -> Path:
    """Compile the wheel (offline) into `wheel_dir`; its path."""
    env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--no-cache-dir",
        "-w",
        str(wheel_dir),
        f"--config-settings=build-dir={build_dir}",
        str(source),
    ]
    run_logged(cmd, log, timeout, env)
    [wheel] = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    return wheel


def build_server(source: Path, build_dir: Path, log: Path, timeout: float) -> Path:
    """`llama-server` from the wheel's build directory (its ggml-cuda objects reused)."""
    jobs = str(os.cpu_count() or 4)
    started = time.monotonic()
    run_logged(["cmake", "-S", str(source), "-B", str(build_dir), *SERVER_ARGS], log, timeout)
    left = max(timeout - (time.monotonic() - started), 1)
    run_logged(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs], log, left)
    [server] = sorted(build_dir.rglob("bin/llama-server"))
    return server


def log_tail(log: Path, limit: int = 4000) -> str:
    if not log.exists():
        return ""
    with open(log, "rb") as f:
        f.seek(max(log.stat().st_size - limit, 0))
        return f.read().decode(errors="replace")
