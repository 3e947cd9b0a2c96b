"""The GPU check's design, rehearsed on CPU (issue 20, item 3): the pack's manifest and trimmed
sdist, the CUDA arch from nvidia-smi, the cache bundle's split and join, the generated GGUF on
the venv's llama.cpp, and a whole run of `bench.gpu.check` with the CUDA steps skipped, so a
typo never costs a lent GPU's minutes. Nothing here downloads anything."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench.gpu import bundle
from bench.gpu.build import cuda_cmake_args
from bench.gpu.model import TINY, write_model
from bench.gpu.pack import CARRY_LIMIT, ROOTS, closure, manifest, slim_sdist
from bench.gpu.probe import cuda_arch, parse_smi

ROOT = Path(__file__).resolve().parents[2]
CPU_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
H100 = "NVIDIA H100 80GB HBM3, 9.0, 81559, 1, 81080, 580.95.05\n"


def test_the_cuda_arch_is_read_from_nvidia_smi() -> None:
    [gpu] = parse_smi(H100)
    assert (gpu.name, gpu.cuda_arch, gpu.total_mib, gpu.free_mib) == ("NVIDIA H100 80GB HBM3", "90", 81559, 81080)
    assert [g.cuda_arch for g in parse_smi(H100 + H100.replace("9.0", "12.0"))] == ["90", "120"]
    assert cuda_arch("8.9") == "89"
    with pytest.raises(ValueError):
        cuda_arch("[N/A]")
    with pytest.raises(ValueError):
        parse_smi("NVIDIA H100, 9.0\n")


def test_the_cuda_build_flags_keep_the_project_flags_and_name_one_arch() -> None:
    args = cuda_cmake_args(CPU_ARGS + " -DGGML_CUDA=ON", "90").split()
    assert args[: len(CPU_ARGS.split())] == CPU_ARGS.split()
    assert args.count("-DGGML_CUDA=ON") == 1 and args[-1] == "-DCMAKE_CUDA_ARCHITECTURES=90"


def test_the_pack_manifest_counts_every_file_against_the_carry_limit(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"y" * 500)
    (tmp_path / "manifest.json").write_text("{}")  # the manifest never counts itself
    found = manifest(tmp_path, tree=7 * 2**20)
    assert found["files"] == {"llama_cpp_python-0.3.36.tar.gz": 500, "wheels/a.whl": 1000}
    assert found["total_bytes"] == 7 * 2**20 + 1500 and found["fits"]
    assert not manifest(tmp_path, tree=CARRY_LIMIT)["fits"]


def test_the_trimmed_sdist_keeps_what_the_build_reads(tmp_path: Path) -> None:
    names = {
        "llama_cpp_python-0.3.36/CMakeLists.txt": True,
        "llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp/objects/pack/p.pack": False,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-gemma-4.gguf": False,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/docs/ops/CUDA.csv": False,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu": True,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp": False,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/server.cpp": True,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui/CMakeLists.txt": True,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui/src/app.ts": False,
        "llama_cpp_python-0.3.36/vendor/llama.cpp/scripts/ui-assets.cmake": True,
    }
    source = tmp_path / "full.tar.gz"
    with tarfile.open(source, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    sizes = slim_sdist(source, tmp_path / "slim.tar.gz")
    with tarfile.open(tmp_path / "slim.tar.gz") as tar:
        assert set(tar.getnames()) == {name for name, kept in names.items() if kept}
    assert sizes == {"kept_bytes": 15, "dropped_bytes": 15}


def test_the_carried_wheels_are_what_the_gpu_tests_import_minus_the_device_s_own() -> None:
    packages = closure(ROOTS)
    assert {"gguf", "django", "djangorestframework", "pydantic", "pydantic-core", "celery", "pillow"} <= set(packages)
    assert not {"numpy", "jinja2", "psutil", "pytest", "nvidia-ml-py"} & set(packages)


def test_a_bundle_is_cut_into_parts_and_joined_back(tmp_path: Path) -> None:
    wheel, server = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", tmp_path / "llama-server"
    wheel.write_bytes(os.urandom(5000))
    server.write_bytes(os.urandom(3000))
    parts = bundle.pack([wheel, server], "k1", tmp_path / "out", "llama-cuda-k1", part_bytes=2048)
    assert len(parts) > 3 and all(p.stat().st_size <= 2048 for p in parts)
    assert bundle.find_parts(tmp_path / "out") == {"llama-cuda-k1": parts}
    files = bundle.unpack(parts, "k1", tmp_path / "back")
    assert files[wheel.name].read_bytes() == wheel.read_bytes()
    assert files["llama-server"].read_bytes() == server.read_bytes()
    with pytest.raises(ValueError, match="build k1"):
        bundle.unpack(parts, "k2", tmp_path / "other")
    with pytest.raises(ValueError, match="missing"):
        bundle.unpack(parts[:1] + parts[2:], "k1", tmp_path / "gap")
    damaged = bytearray(parts[1].read_bytes())  # inside the wheel's bytes
    damaged[1000] ^= 0xFF
    parts[1].write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="does not match"):
        bundle.unpack(parts, "k1", tmp_path / "damaged")


def test_the_generated_model_loads_on_llama_cpp_and_answers_greedily_the_same_twice(tmp_path: Path) -> None:
    import llama_cpp

    from memory.planner import footprint_from_gguf

    path = write_model(tmp_path / "tiny.gguf", TINY)
    fp = footprint_from_gguf(path)
    assert fp.n_layers == TINY.layers and fp.weights_bytes == TINY.bytes()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    try:
        completions = [llm.create_completion("abc", max_tokens=12, temperature=0.0) for _ in range(2)]
        answers = [c["choices"][0] for c in completions if isinstance(c, dict)]
    finally:
        llm.close()
    assert len(answers) == 2 and answers[0]["text"] == answers[1]["text"] and answers[0]["finish_reason"] == "length"


def tiny_wheel(folder: Path) -> Path:
    """A real, installable wheel of one module (the check's wheels step installs what it finds)."""
    folder.mkdir(parents=True)
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    meta = "gpu_check_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gpu_check_probe.py", "VALUE = 1\n")
        z.writestr(f"{meta}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n")
        z.writestr(f"{meta}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{meta}/RECORD", "")
    return path


@pytest.mark.timeout(120)
def test_a_cpu_run_of_the_check_skips_the_cuda_steps_and_reports_every_step(tmp_path: Path) -> None:
    carry, out = tmp_path / "carry", tmp_path / "out"
    tiny_wheel(carry / "wheels")
    detail = {"onnxruntime-gpu": {"detail": "onnxruntime_gpu-1.31.1-cp312.whl 243.7 MiB = 243.7 MiB"}}
    (carry / "manifest.json").write_text(json.dumps({"not_carried": detail}))
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "HYPNOS_GPU_TESTS")}
    env.update(LLAMA_VERSION="0.3.36", LLAMA_CMAKE_ARGS=CPU_ARGS)
    cmd = [sys.executable, "-m", "bench.gpu.check", str(out), "--carry", str(carry), "--budget-secs", "100"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [
        "detect", "wheels", "cuda-build", "llama-server", "imports", "model", "gpu-tests", "chat-bench",
        "onnxruntime-gpu", "cuda-whisper", "sd-cpp-cuda",
    ]  # fmt: skip
    assert {k: s["status"] for k, s in steps.items()} == {
        "detect": "skipped", "wheels": "ok", "cuda-build": "skipped", "llama-server": "skipped", "imports": "ok",
        "model": "ok", "gpu-tests": "skipped", "chat-bench": "skipped",
        "onnxruntime-gpu": "not-run", "cuda-whisper": "not-run", "sd-cpp-cuda": "not-run",
    }  # fmt: skip
    assert "no NVIDIA GPU" in steps["detect"]["reason"]
    assert steps["wheels"]["figures"]["wheels"] == 1
    assert steps["imports"]["figures"]["gpu_offload"] is False
    assert steps["model"]["figures"]["shape"]["layers"] == TINY.layers
    tests = steps["gpu-tests"]["figures"]
    assert tests["tests"] >= 6 and tests["skipped"] == tests["tests"] and tests["failed"] == tests["errors"] == 0
    assert all(case["reason"].startswith("GPU test: ") for case in tests["cases"])
    assert "243.7 MiB" in steps["onnxruntime-gpu"]["reason"]
    assert "gpu-check pack" not in steps["cuda-whisper"]["reason"] and "MiB" in steps["cuda-whisper"]["reason"]
    assert report["counts"] == {"ok": 3, "failed": 0, "skipped": 5, "not-run": 3}
    assert (out / "gpu-tests.xml").exists() and (out / "gpu-check.log").exists()


def test_the_gpu_tests_stay_out_of_the_ordinary_suite() -> None:
    import tests.conftest

    expected = [] if os.environ.get("HYPNOS_GPU_TESTS") == "1" else ["gpu"]
    assert tests.conftest.collect_ignore == expected
