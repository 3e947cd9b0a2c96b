"""The GPU check, run by `./run.sh gpu-check OUTDIR` on a lent GPU machine (and rehearsed on CPU).

Steps, each recorded in OUTDIR/gpu-check.json (name, status ok / failed / skipped / not-run,
seconds, figures, reason), the report rewritten after every step:

  detect         nvidia-smi and NVML: the GPU, its compute capability (the CUDA arch to build)
  wheels         the carried pure-Python wheels installed into a private site folder
  cuda-build     llama-cpp-python with CUDA: restored from a cache bundle of the same build key,
                 else compiled from the carried sdist for the detected arch only (time-boxed);
                 the wheel is bundled into OUTDIR at once, so a later kill still leaves it
  llama-server   llama.cpp's server from the same build directory (time-boxed), bundled too
  imports        the modules the GPU tests use import on this interpreter (no Django set-up)
  model          a random-weight llama GGUF of --model-mib MiB (tiny on CPU)
  gpu-tests      pytest tests/gpu with a JUnit file; the tests' measured figures merged in
  chat-bench     Hypnos's engine against llama-server on the same GGUF (bench/gpu/chat_bench.py)
  onnxruntime-gpu, cuda-whisper, sd-cpp-cuda
                 recorded as not run, with the reason and the MiB that could not be carried

Without a GPU the CUDA steps are skipped with their reason and the rest runs, which is what
tests/unit/test_gpu_check.py checks, so a typo never costs the device's minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from bench.gpu import build, bundle, probe
from bench.gpu.model import TINY, shape_for
from bench.gpu.report import Report, Step, StepSkipped

ROOT = Path(__file__).resolve().parents[2]
REPORT = "gpu-check.json"
JUNIT = "gpu-tests.xml"
LOG = "gpu-check.log"
LOG_TAIL_BYTES = 2 * 2**20
# A second copy of the bundle inside the device's checkout (git-ignored): a later call on the
# same warm machine keeps ignored files, so it restores the build in seconds.
LOCAL_CACHE = ROOT / ".gpu-build"
# At most 8 files come back from a device run: the report, the JUnit file, the log, the parts.
MAX_PARTS = 5
# The device runs one command for at most 10 minutes: the check stops starting work this long
# before its budget ends, to bundle and report.
RESERVE_SECS = 25
BUILD_MAX_SECS = 420
SERVER_MIN_SECS = 90
TESTS_MAX_SECS = 240
BENCH_MAX_SECS = 120


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path = args.outdir.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="hypnos-gpu-check-"))
        self.site = self.work / "site"
        self.log = self.work / LOG
        self.deadline = time.monotonic() + args.budget_secs
        self.gpu: probe.SmiGpu | None = None
        self.nvml: dict[str, Any] | None = None
        self.wheel: Path | None = None
        self.server: Path | None = None
        self.built_here = False
        # Set by a compile in this run: the unpacked sdist (llama-server builds from it) and the key.
        self.source: Path | None = None
        self.key = ""
        self.model: Path | None = None
        # Folders of CUDA libraries the built engine needs at run time (cuBLAS, cudart).
        self.cuda_libs: list[str] = []
        self.version = os.environ.get("LLAMA_VERSION", "")
        self.cmake_args = os.environ.get("LLAMA_CMAKE_ARGS", "")
        manifest = args.carry / "manifest.json"
        self.manifest: dict[str, Any] = json.loads(manifest.read_text()) if manifest.exists() else {}
        self.report = Report(
            self.out / REPORT,
            {
                "check": "hypnos gpu-check (issue 20)",
                "python": sys.version.split()[0],
                "llama_version": self.version,
                "carry": str(args.carry),
                "budget_secs": args.budget_secs,
                "started_unix": int(time.time()),
            },
        )

    # -- helpers -----------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, **extra: str) -> dict[str, str]:
        """This interpreter's environment with the private site folder and the checkout first."""
        paths = [str(self.site), str(ROOT), os.environ.get("PYTHONPATH", "")]
        libs = [*self.cuda_libs, os.environ.get("LD_LIBRARY_PATH", "")]
        return dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in paths if p),
            LD_LIBRARY_PATH=os.pathsep.join(p for p in libs if p),
            **extra,
        )

    def save_log(self) -> None:
        if self.log.exists():
            shutil.copyfile(self.log, self.out / LOG)
            if self.log.stat().st_size > LOG_TAIL_BYTES:
                (self.out / LOG).write_text(build.log_tail(self.log, LOG_TAIL_BYTES))

    def require_gpu(self) -> probe.SmiGpu:
        if self.gpu is None:
            raise StepSkipped("no NVIDIA GPU on this machine (see the detect step)")
        return self.gpu

    # -- steps -------------------------------------------------------------------------------

    def run(self) -> Report:
        steps = [
            ("detect", self.detect),
            ("wheels", self.install_wheels),
            ("cuda-build", self.cuda_build),
            ("llama-server", self.llama_server),
            ("imports", self.imports),
            ("model", self.make_model),
            ("gpu-tests", self.gpu_tests),
            ("chat-bench", self.chat_bench),
        ]
        for name, fn in steps:
            with self.report.step(name) as step:
                fn(step)
            self.save_log()
        self.not_carried()
        self.report.about["finished_unix"] = int(time.time())
        self.report.write()
        return self.report

    def detect(self, step: Step) -> None:
        gpus = probe.query_smi()
        self.nvml, why = probe.nvml_device()
        step.figures["nvidia_smi"] = [gpu.__dict__ | {"cuda_arch": gpu.cuda_arch} for gpu in gpus]
        step.figures["nvml"] = self.nvml or why
        if not gpus or self.nvml is None:
            raise StepSkipped(f"no NVIDIA GPU: nvidia-smi lists {len(gpus)}; {why or 'NVML sees one'}")
        self.gpu = gpus[0]
        step.figures["cuda_arch"] = self.gpu.cuda_arch
        if shutil.which("nvcc"):
            done = subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
            step.figures["nvcc"] = done.stdout.strip().splitlines()[-1:]

    def install_wheels(self, step: Step) -> None:
        wheels = sorted((self.args.carry / "wheels").glob("*.whl"))
        if not wheels:
            raise StepSkipped(f"no wheels carried in {self.args.carry}/wheels: this interpreter's packages are used")
        self.site.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(self.site)]
        build.run_logged([*cmd, *map(str, wheels)], self.log, timeout=120)
        step.figures.update(wheels=len(wheels), mib=round(sum(w.stat().st_size for w in wheels) / 2**20, 1))

    def cuda_build(self, step: Step) -> None:
        gpu = self.require_gpu()
        args = build.cuda_cmake_args(self.cmake_args, gpu.cuda_arch)
        key = bundle.build_key(self.version, args, gpu.cuda_arch)
        cublas, self.cuda_libs = build.find_cublas()
        step.figures.update(cmake_args=args, build_key=key, cublas=cublas or "the toolkit's", cuda_libs=self.cuda_libs)
        # cuBLAS's location is this machine's, not the build's: it stays out of the key.
        args = " ".join([args, *cublas])
        restored = self.restore_bundle(key, step)
        if restored is None:
            restored = self.compile(args, key, step)
        self.wheel = restored
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade"]
        build.run_logged([*cmd, "--target", str(self.site), str(self.wheel)], self.log, timeout=120)
        step.figures["wheel_mib"] = round(self.wheel.stat().st_size / 2**20, 1)

    def restore_bundle(self, key: str, step: Step) -> Path | None:
        """The wheel (and llama-server) of a cached bundle with this build key, if one is here."""
        for folder in [self.args.carry / "cache", LOCAL_CACHE, *self.args.cache]:
            for stem, parts in bundle.find_parts(folder).items():
                try:
                    files = bundle.unpack(parts, key, self.work / "cached")
                except ValueError as exc:
                    step.figures.setdefault("cache_rejected", []).append(f"{stem}: {exc}")
                    continue
                step.figures["source"] = f"cache bundle {stem} ({len(parts)} parts)"
                if "llama-server" in files:
                    self.server = files["llama-server"]
                    self.server.chmod(0o755)
                return next(p for name, p in files.items() if name.endswith(".whl"))
        return None

    def compile(self, args: str, key: str, step: Step) -> Path:
        sdists = sorted(self.args.carry.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise FileNotFoundError(
                f"no cached build with key {key} and no llama-cpp-python sdist in {self.args.carry}"
            )
        source = build.extract_sdist(sdists[-1], self.work / "src")
        timeout = min(BUILD_MAX_SECS, self.left() - RESERVE_SECS - 60)
        step.figures.update(source=f"compiled from {sdists[-1].name}", timeout_secs=round(timeout))
        started = time.monotonic()
        try:
            wheel = build.build_wheel(source, self.work / "build", self.work / "wheel", args, self.log, timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"the CUDA build ran past {timeout:.0f} s:\n{build.log_tail(self.log)}") from exc
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"the CUDA build failed:\n{build.log_tail(self.log)}") from exc
        step.figures["compile_secs"] = round(time.monotonic() - started, 1)
        self.source, self.built_here, self.key = source, True, key
        self.bundle([wheel], step)
        return wheel

    def bundle(self, files: list[Path], step: Step) -> bool:
        """Keep the build for the next run: OUTDIR gets its parts (the older parts replaced),
        and so does the checkout's .gpu-build/. False (nothing kept) when the parts would be
        more than what may come back beside the report, the JUnit file and the log."""
        for old in [*self.out.glob(f"*{bundle.SUFFIX}*"), *LOCAL_CACHE.glob(f"*{bundle.SUFFIX}*")]:
            old.unlink()
        stem = f"llama-cuda-{self.key}"
        parts = bundle.pack(files, self.key, self.out, stem)
        mib = round(sum(p.stat().st_size for p in parts) / 2**20, 1)
        if len(parts) > MAX_PARTS:
            for part in parts:
                part.unlink()
            step.figures["bundle"] = f"not kept: {mib} MiB is more than {MAX_PARTS} parts of 15 MiB"
            return False
        LOCAL_CACHE.mkdir(exist_ok=True)
        for part in parts:
            shutil.copyfile(part, LOCAL_CACHE / part.name)
        step.figures["bundle"] = {"parts": [p.name for p in parts], "mib": mib}
        return True

    def llama_server(self, step: Step) -> None:
        self.require_gpu()
        if self.server is not None:
            step.figures["source"] = "cache bundle"
            return
        if not self.built_here or self.wheel is None or self.source is None:
            raise StepSkipped("no CUDA build in this run to build llama-server from", status="not-run")
        timeout = self.left() - RESERVE_SECS - TESTS_MAX_SECS // 2
        if timeout < SERVER_MIN_SECS:
            raise StepSkipped(
                f"{self.left():.0f} s left: not enough to build llama-server and run the tests", "not-run"
            )
        server = build.build_server(self.source, self.work / "build", self.log, timeout)
        self.server = server
        libs = wheel_libs(self.wheel)
        extra = [so for so in sorted(server.parent.glob("*.so*")) if so.name.split(".so")[0] not in libs]
        # The bundle stores files flat: llama-server finds these beside itself (LD_LIBRARY_PATH),
        # and the wheel's own libraries (libggml-cuda among them) in the installed wheel.
        step.figures["libraries_bundled"] = [so.name for so in extra]
        if not self.bundle([self.wheel, server, *extra], step):
            self.bundle([self.wheel], step)  # the wheel alone is what saves the next run's minutes

    def imports(self, step: Step) -> None:
        code = (
            "import json, llama_cpp, memory.manager, memory.kv_park, inference.engines.llama;"
            "print(json.dumps({'llama_cpp': llama_cpp.__version__, 'file': llama_cpp.__file__,"
            " 'gpu_offload': bool(llama_cpp.llama_supports_gpu_offload())}))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env(), timeout=120)
        if done.returncode:
            raise RuntimeError(done.stderr.strip()[-3000:])
        step.figures.update(json.loads(done.stdout.strip().splitlines()[-1]))
        if self.gpu is not None and not step.figures["gpu_offload"]:
            raise RuntimeError("llama_cpp imported here is not a GPU build")

    def make_model(self, step: Step) -> None:
        # Written by the interpreter the tests use (the gguf package may be a carried wheel).
        mib = self.args.model_mib if self.gpu is not None else 0
        shape = shape_for(mib) if mib else TINY
        path = self.work / "gpu-check.gguf"
        cmd = [sys.executable, "-m", "bench.gpu.model", str(path), "--mib", str(mib)]
        build.run_logged(cmd, self.log, timeout=300, env=self.env())
        self.model = path
        step.figures.update(shape=shape.__dict__, mib=round(path.stat().st_size / 2**20, 1))

    def gpu_tests(self, step: Step) -> None:
        figures = self.work / "figures.jsonl"
        timeout = min(TESTS_MAX_SECS, self.left() - RESERVE_SECS)
        cmd = [
            sys.executable, "-m", "pytest", "tests/gpu",
            "-c", "bench/gpu/pytest.ini", "--rootdir", str(ROOT), "-p", "no:cacheprovider",
            f"--junitxml={self.out / JUNIT}", f"--timeout={max(int(timeout) - 10, 30)}",
        ]  # fmt: skip
        extra = {"HYPNOS_GPU_TESTS": "1", "HYPNOS_GPU_FIGURES": str(figures)}
        if self.model is not None:
            extra["HYPNOS_GPU_MODEL"] = str(self.model)
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            subprocess.run(cmd, cwd=ROOT, env=self.env(**extra), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        results = junit_results(self.out / JUNIT)
        measured = [json.loads(line) for line in figures.read_text().splitlines()] if figures.exists() else []
        step.figures.update(results)
        step.figures["measured"] = {m["test"]: m["figures"] for m in measured}
        if results["failed"] or results["errors"]:
            raise RuntimeError(
                f"{results['failed']} failed, {results['errors']} errors of {results['tests']} GPU tests"
            )
        if results["tests"] and results["skipped"] == results["tests"]:
            reasons = sorted({t["reason"] for t in results["cases"] if t["outcome"] == "skipped"})
            raise StepSkipped(f"every GPU test skipped: {'; '.join(reasons)}")

    def chat_bench(self, step: Step) -> None:
        self.require_gpu()
        if self.model is None:
            raise StepSkipped("no model was generated", "not-run")
        timeout = min(BENCH_MAX_SECS, self.left() - RESERVE_SECS)
        if timeout < 30:
            raise StepSkipped(f"{self.left():.0f} s left: no time for the benchmark", "not-run")
        result = self.work / "chat-bench.json"
        cmd = [sys.executable, "-m", "bench.gpu.chat_bench", str(self.model), "--json", str(result)]
        if self.server is not None:
            cmd += ["--server", str(self.server)]
        build.run_logged(cmd, self.log, timeout, env=self.env())
        step.figures.update(json.loads(result.read_text()))

    def not_carried(self) -> None:
        """The GPU paths whose packages cannot travel to an offline device beside the llama
        sdist: recorded as not run, with the sizes the pack step measured on the registry."""
        sizes = self.manifest.get("not_carried", {})
        for name, reason in NOT_CARRIED.items():
            about = sizes.get(name, {})
            mib = f" ({about['detail']})" if about.get("detail") else " (sizes not measured: run ./run.sh gpu-pack)"
            self.report.record(name, "not-run", reason + mib, **about)


NOT_CARRIED = {
    "onnxruntime-gpu": "onnxruntime-gpu (Piper, Kokoro on CUDA) does not fit the 64 MiB carry: the device has the "
    "CPU build of onnxruntime only",
    "cuda-whisper": "faster-whisper on CUDA needs ctranslate2, av and tokenizers wheels and a Whisper model, "
    "together far over the 64 MiB carry",
    "sd-cpp-cuda": "stable-diffusion.cpp with CUDA compiles ggml-cuda a second time, which does not fit the "
    "10-minute command beside llama.cpp's build, and its sdist is large",
}


def wheel_libs(wheel: Path) -> set[str]:
    """The shared libraries inside a wheel, by name without the .so suffix and version."""
    with zipfile.ZipFile(wheel) as z:
        return {Path(n).name.split(".so")[0] for n in z.namelist() if ".so" in Path(n).name}


def junit_results(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes (with skip reasons) of a pytest JUnit XML file."""
    if not path.exists():
        return {"tests": 0, "failed": 0, "errors": 1, "skipped": 0, "passed": 0, "cases": []}
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or child.text or "").strip()[:2000]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "reason": reason})
    count = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "error", "skipped")}
    return {
        "tests": len(cases),
        "passed": count["passed"],
        "failed": count["failed"],
        "errors": count["error"],
        "skipped": count["skipped"],
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="where the report, the JUnit file and the cache bundle go ($OUT)")
    parser.add_argument("--carry", type=Path, default=ROOT / ".gpu", help="the folder ./run.sh gpu-pack filled")
    parser.add_argument("--cache", type=Path, action="append", default=[], help="more folders to look for bundles in")
    parser.add_argument("--budget-secs", type=float, default=570, help="stop starting work after this long")
    parser.add_argument("--model-mib", type=int, default=1024, help="size of the generated GGUF on a GPU")
    args = parser.parse_args(argv)
    report = Check(args).run()
    for s in report.steps:
        print(f"{s.name:16} {s.status:8} {s.seconds:7.1f}s  {s.reason or ''}".rstrip()[:300])
    print(f"report: {args.outdir / REPORT}")
    return 1 if any(s.status == "failed" for s in report.steps) else 0


if __name__ == "__main__":
    sys.exit(main())
