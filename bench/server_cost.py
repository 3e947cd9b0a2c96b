"""The server's own cost against its peers, side by side in one run (issue 13).

Five targets serve SmolLM2-135M-Instruct (the suite's GGUF) with the same threads, greedy, on
the same prompt, one after the other (never two at once):

- ``raw``: ``llama_cpp.Llama`` in this process (no HTTP);
- ``llama_cpp_server``: ``python -m llama_cpp.server`` from a throwaway venv holding the same
  cached llama-cpp-python wheel as ``.venv`` (``run.sh``'s build) plus its server extras;
- ``llama_server``: llama.cpp's own C++ ``llama-server``, built from the llama.cpp sources
  vendored in the llama-cpp-python sdist with ``run.sh``'s CPU flags;
- ``embedded`` and ``distributed``: Hypnos (``python -m hypnos_site.serve``, and for
  ``distributed`` also ``manage.py runinference`` over Redis).

Measured per target: (a) a non-streamed ``max_tokens: 1`` call on a warm, cached prompt (client
p50, and for Hypnos the part of it above the engine's own time from ``hypnos_telemetry``);
(b) TTFT p50 of a streamed call on the same warm prompt; (c) streamed decode tok/s of 128
tokens; then on a 4-slot server (d) the aggregate tok/s of 4 concurrent streams and (e) a single
stream again after them (and once more after the server sat idle). The table compares them with
the issue's targets. bench/README.md describes the method.

    .venv/bin/python bench/server_cost.py --setup-only     # build / cache the peers (once)
    .venv/bin/python bench/server_cost.py --json /tmp/server_cost.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from chat_stream import (  # noqa: E402  (bench/chat_stream.py: load, processes, stream clock)
    BASE_DIR,
    MESSAGES,
    QUIET_IDLE_PCT,
    CpuMeter,
    Proc,
    StreamClock,
    _clear_redis,
    _fmt,
    cpu_idle_pct,
    free_port,
    migrate,
    redis_server_pids,
    server_env,
    wait_until_quiet,
)

from hypnos_site.config import load_config  # noqa: E402

log = logging.getLogger("bench.server_cost")

TARGETS = ("raw", "llama_cpp_server", "llama_server", "embedded", "distributed")
HYPNOS_TARGETS = ("embedded", "distributed")
MODEL_ID = "smollm2-135m"
CONTEXT_LEN = 4096
SLOTS = 4
READY_TIMEOUT_SECS = 180.0
REQUEST_TIMEOUT_SECS = 300.0
# How long the 4-slot server sits idle before the last single stream ("stays there").
IDLE_AFTER_CONCURRENT_SECS = 5.0

# The targets (issue 13).
TARGET_OVERHEAD_MS = 3.0  # p50 server time above the engine's, non-streamed, warm prompt
TARGET_TTFT_VS_LLAMA_CPP_SERVER = 1.1  # at most
TARGET_DECODE_VS_LLAMA_SERVER = {"embedded": 0.9, "distributed": 0.85}  # at least
TARGET_AGGREGATE_VS_LLAMA_SERVER = 0.9  # at least, same slots
TARGET_AFTER_VS_BEFORE = 0.9  # (e): a single stream after (d) keeps this share of the one before

# -- set-up of the peers, cached like run.sh's wheel ---------------------------------------------

RUN_SH = BASE_DIR / "run.sh"
# Beyond run.sh's CPU flags: only the server, statically linked, no network at build time
# (LLAMA_CURL is deprecated in this llama.cpp and only warns; the prebuilt web UI is a download).
LLAMA_SERVER_CMAKE_EXTRA = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# llama-cpp-python 0.3.36's `server` extra, pinned (starlette-context must stay below 0.4).
LLAMA_CPP_SERVER_PINS = (
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "sse-starlette==3.7.0",
    "starlette-context==0.3.6",
    "pydantic-settings==2.16.3",
    "PyYAML==6.0.4",
    # llama-cpp-python's own dependencies, as in .venv
    "numpy==2.4.6",
    "Jinja2==3.1.6",
    "diskcache==5.6.3",
    "typing_extensions==4.16.0",
)


def cache_dir() -> Path:
    """run.sh's CACHE_DIR: HYPNOS_CACHE_DIR, else $XDG_CACHE_HOME/hypnos, else ~/.cache/hypnos."""
    if os.environ.get("HYPNOS_CACHE_DIR"):
        return Path(os.environ["HYPNOS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hypnos"


def run_sh_llama() -> tuple[str, str]:
    """LLAMA_VERSION and LLAMA_CMAKE_ARGS as run.sh sets them (CPU build), read from run.sh so
    that the peers are built exactly like the server's engine. run.sh's top-level assignments
    are read in order, with `$NAME` references to earlier ones expanded."""
    assigned: dict[str, str] = {}
    for match in re.finditer(r'^([A-Z_]+)=("([^"]*)"|(\S*))$', RUN_SH.read_text(), re.M):
        value = match.group(3) if match.group(3) is not None else match.group(4)
        assigned.setdefault(match.group(1), re.sub(r"\$(\w+)", lambda m: assigned.get(m.group(1), ""), value))
    version, flags = assigned.get("LLAMA_VERSION"), assigned.get("LLAMA_CMAKE_ARGS")
    if not version or not flags:
        raise RuntimeError(f"cannot read LLAMA_VERSION / LLAMA_CMAKE_ARGS from {RUN_SH}")
    return version, flags


def _key(*parts: str) -> str:
    """run.sh's cache key: the first 12 hex digits of sha256 over the parts joined by spaces."""
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:12]


def _run(
    args: list[str], log_path: Path, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 3600
) -> None:
    """Run a set-up command, its output appended to `log_path`; fail with its last lines."""
    log.info("set-up: %s", " ".join(args))
    with log_path.open("ab") as out:
        out.write(f"\n$ {' '.join(args)}\n".encode())
        out.flush()
        done = subprocess.run(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout
        )
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{args[0]} failed ({done.returncode}); {log_path}:\n{tail}")


def llama_sdist(version: str) -> Path:
    """The llama-cpp-python sdist, downloaded once into CACHE/sdists/."""
    target_dir = cache_dir() / "sdists"
    found = sorted(target_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "--disable-pip-version-check",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                f"llama-cpp-python=={version}",
            ],
            target_dir / "download.log",
        )
        [sdist] = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        final = target_dir / sdist.name
        sdist.rename(final)
    return final


def llama_server_binary() -> tuple[Path, dict[str, Any]]:
    """llama.cpp's `llama-server`, built once per version and flags from the llama.cpp vendored
    in the llama-cpp-python sdist (`nice -n 19`, two jobs), kept in CACHE/llama-server/."""
    version, flags = run_sh_llama()
    cmake_args = [*flags.split(), *LLAMA_SERVER_CMAKE_EXTRA]
    key = _key(version, *cmake_args)
    home = cache_dir() / "llama-server" / f"llama-server-{version}-{key}"
    binary = home / "llama-server"
    info = {"version": version, "cmake_args": cmake_args, "path": str(binary), "key": key}
    if binary.exists():
        return binary, info
    sdist = llama_sdist(version)
    work = Path(f"{home}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build_log = work / "build.log"
    log.info("building llama-server %s (once per machine; tens of minutes on 2 cores), log %s", version, build_log)
    with tarfile.open(sdist) as archive:
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(work, members=members, filter="data")
    source = work / prefix
    nice = ["nice", "-n", "19"]
    _run([*nice, "cmake", "-S", str(source), "-B", str(work / "build"), *cmake_args], build_log)
    _run([*nice, "cmake", "--build", str(work / "build"), "--target", "llama-server", "-j2"], build_log)
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "build" / "bin" / "llama-server", binary)
    (home / "flags.txt").write_text(" ".join(cmake_args) + "\n")
    shutil.copy2(build_log, home / "build.log")
    shutil.rmtree(work, ignore_errors=True)
    return binary, info


def llama_cpp_server_python() -> tuple[Path, dict[str, Any]]:
    """The python of a throwaway venv with the cached llama-cpp-python wheel (the one `.venv`
    has: run.sh's build, same flags) and its pinned server extras, kept in CACHE/venvs/."""
    version, flags = run_sh_llama()
    wheel_key = _key(version, flags)
    wheels = sorted((cache_dir() / "wheels" / f"llama-cpp-python-{version}-{wheel_key}").glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise RuntimeError(f"no cached llama-cpp-python {version} wheel for {flags!r}; run ./run.sh setup first")
    wheel = wheels[0]
    venv = cache_dir() / "venvs" / f"llama-cpp-server-{version}-{_key(wheel_key, *LLAMA_CPP_SERVER_PINS)}"
    python = venv / "bin" / "python"
    info = {"wheel": str(wheel), "venv": str(venv), "pins": list(LLAMA_CPP_SERVER_PINS)}
    if (venv / ".complete").exists():
        return python, info
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    setup_log = venv.parent / f"{venv.name}.log"
    _run([sys.executable, "-m", "venv", str(venv)], setup_log)
    _run([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", str(wheel)], setup_log)
    _run([str(python), "-m", "pip", "--disable-pip-version-check", "install", *LLAMA_CPP_SERVER_PINS], setup_log)
    _run([str(python), "-c", "import llama_cpp.server.app"], setup_log)
    (venv / ".complete").write_text(
        subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    )
    return python, info


# -- what is measured ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What every target is run with."""

    weights: Path
    threads: int
    max_tokens: int
    ttft_max_tokens: int
    runs: int
    calls: int
    retries: int
    wait_idle_secs: float
    max_foreign_cpu_pct: float
    redo: int
    idle_secs: float


@dataclass
class Load:
    """How quiet the machine was around one sample (see chat_stream.py: noise)."""

    idle_before_pct: float | None = None
    foreign_cpu_pct: float | None = None
    disturbed: bool = False


@dataclass
class CallSample(Load):
    """(a) one non-streamed max_tokens 1 call on the warm prompt."""

    client_ms: float = 0.0
    # The engine's own time as the server reports it (Hypnos: inference_latency_ms of
    # hypnos_telemetry; llama-server: timings.prompt_ms + predicted_ms); None where none is given.
    engine_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""

    @property
    def above_engine_ms(self) -> float | None:
        return None if self.engine_ms is None else self.client_ms - self.engine_ms


@dataclass
class StreamSample(Load):
    """(b), (c), (e): one streamed call; perf_counter stamps kept for the concurrent rounds."""

    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    content_chunks: int = 0
    total_ms: float = 0.0
    finish_reason: str | None = None
    # The server's own figures (Hypnos: hypnos_telemetry.engine; llama-server: timings).
    engine_ttft_ms: float | None = None
    engine_decode_tokens_per_s: float | None = None
    concurrent_slots: int | None = None
    text: str = ""
    started_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0


@dataclass
class ConcurrentSample(Load):
    """(d) one round of SLOTS streams sent at once."""

    aggregate_tokens_per_s: float = 0.0
    wall_ms: float = 0.0
    completion_tokens: int = 0
    streams: list[StreamSample] = field(default_factory=list)


@dataclass
class Series:
    """The kept samples of one measurement, and those thrown away as disturbed."""

    samples: list[Any] = field(default_factory=list)
    discarded: list[Any] = field(default_factory=list)

    def p50(self, name: str) -> float | None:
        values = [v for v in (getattr(s, name) for s in self.samples) if v is not None]
        return statistics.median(values) if values else None

    def disturbed(self) -> int:
        return sum(1 for s in self.samples if s.disturbed)


@dataclass
class TargetResult:
    target: str
    series: dict[str, Series] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    slots: int | None = None

    def p50(self, series: str, name: str) -> float | None:
        return self.series[series].p50(name) if series in self.series else None


class Sampler:
    """Runs one measurement's samples: waits for a quiet machine, meters the CPU that other
    processes take meanwhile, measures a disturbed sample again (`redo` times per series at
    most) and sends a failed request again (`retries` times)."""

    def __init__(self, settings: Settings, result: TargetResult, pids: Callable[[], list[int]]):
        self.settings = settings
        self.result = result
        self.pids = pids

    def run(self, name: str, request: Callable[[], Any], count: int, quiet_each: bool = True) -> Series:
        series = self.result.series.setdefault(name, Series())
        label = f"{self.result.target} {name}"
        idle = None if quiet_each else wait_until_quiet(self.settings.wait_idle_secs, label)
        meter = CpuMeter(self.pids())
        while len(series.samples) < count:
            if quiet_each:
                idle = wait_until_quiet(self.settings.wait_idle_secs, f"{label} {len(series.samples) + 1}/{count}")
            meter.start()
            sample = self._with_retries(request, label)
            sample.idle_before_pct, sample.foreign_cpu_pct = idle, meter.foreign_pct()
            sample.disturbed = (
                sample.foreign_cpu_pct is not None and sample.foreign_cpu_pct > self.settings.max_foreign_cpu_pct
            )
            if sample.disturbed and len(series.discarded) < self.settings.redo:
                log.debug("%s: others took %.0f%% of the CPU; measuring again", label, sample.foreign_cpu_pct)
                series.discarded.append(sample)
                continue
            series.samples.append(sample)
        log.info("%s: %s", label, _describe(name, series))
        return series

    def _with_retries(self, request: Callable[[], Any], label: str) -> Any:
        for attempt in range(self.settings.retries + 1):
            try:
                return request()
            except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as exc:
                self.result.failures.append(f"{label}: {exc!r}")
                if attempt == self.settings.retries:
                    raise
                log.warning("%s failed (%r); retrying (%d/%d)", label, exc, attempt + 1, self.settings.retries)
        raise AssertionError("unreachable")


def _describe(name: str, series: Series) -> str:
    if name == "call":
        above = series.p50("above_engine_ms")
        return (
            f"p50 {_fmt(series.p50('client_ms'), 2)} ms client, engine {_fmt(series.p50('engine_ms'), 2)} ms, "
            f"above it {_fmt(above, 2)} ms"
        )
    if name == "concurrent":
        return f"p50 {_fmt(series.p50('aggregate_tokens_per_s'))} tok/s aggregate"
    return (
        f"p50 TTFT {_fmt(series.p50('ttft_ms'), 2)} ms, {_fmt(series.p50('decode_tokens_per_s'))} tok/s, "
        f"tokens {sorted({s.completion_tokens for s in series.samples})}"
    )


def descendants(pids: list[int]) -> list[int]:
    """`pids` and every live process below them (the distributed worker runs in a child of the
    runinference supervisor; its CPU is the target's, not other processes')."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


# -- raw llama-cpp-python ------------------------------------------------------------------------


class RawTarget:
    """`llama_cpp.Llama` in this process, loaded as the server's engine loads it. Nothing is
    reset between calls, so the prompt stays cached as in the servers."""

    name = "raw"

    def __init__(self, settings: Settings):
        import llama_cpp

        self.settings = settings
        self.llm: Any = llama_cpp.Llama(
            model_path=str(settings.weights),
            n_ctx=CONTEXT_LEN,
            n_threads=settings.threads,
            n_threads_batch=settings.threads,
            n_gpu_layers=0,
            verbose=False,
        )

    def close(self) -> None:
        self.llm.close()

    def call(self) -> CallSample:
        started = time.perf_counter()
        response = self.llm.create_chat_completion(messages=MESSAGES, max_tokens=1, temperature=0.0)
        client_ms = (time.perf_counter() - started) * 1000
        usage = response["usage"]
        return CallSample(
            client_ms=client_ms,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            text=response["choices"][0]["message"]["content"] or "",
        )

    def stream(self, max_tokens: int) -> StreamSample:
        clock = StreamClock()
        finish = None
        for chunk in self.llm.create_chat_completion(
            messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, stream=True
        ):
            choice = chunk["choices"][0]
            clock.content(choice["delta"].get("content"))
            finish = choice.get("finish_reason") or finish
        # llama-cpp-python streams one content chunk per generated token.
        return _stream_sample(clock, clock.chunks, None, finish)


def _stream_sample(
    clock: StreamClock, completion_tokens: int, prompt_tokens: int | None, finish: str | None, **extra: Any
) -> StreamSample:
    run = clock.result(completion_tokens, prompt_tokens)
    assert clock.first is not None and clock.last is not None
    return StreamSample(
        ttft_ms=run.ttft_ms,
        decode_tokens_per_s=run.decode_tokens_per_s,
        completion_tokens=completion_tokens,
        prompt_tokens=prompt_tokens,
        content_chunks=run.content_chunks,
        total_ms=run.total_ms,
        finish_reason=finish,
        text=run.text,
        started_at=clock.started,
        first_at=clock.first,
        last_at=clock.last,
        **extra,
    )


# -- the HTTP targets ----------------------------------------------------------------------------


class HttpTarget:
    """An OpenAI-compatible server: POST /v1/chat/completions, greedy, no seed (a seeded Hypnos
    request evaluates its whole prompt again; without one every server keeps it cached)."""

    def __init__(self, name: str, base_url: str, procs: list[Proc]):
        self.name = name
        self.base_url = base_url
        self.procs = procs
        self.client = httpx.Client(timeout=REQUEST_TIMEOUT_SECS)

    def pids(self) -> list[int]:
        ours = [os.getpid(), *descendants([p.popen.pid for p in self.procs])]
        if self.name == "distributed":
            ours += redis_server_pids()
        return ours

    def close(self) -> None:
        self.client.close()

    def _body(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL_ID,
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def call(self) -> CallSample:
        started = time.perf_counter()
        response = self.client.post(f"{self.base_url}/v1/chat/completions", json=self._body(1, False))
        client_ms = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"POST /v1/chat/completions: {response.status_code} {response.text[:300]}")
        data = response.json()
        usage = data.get("usage") or {}
        engine_ms = None
        if "hypnos_telemetry" in data:
            engine_ms = data["hypnos_telemetry"]["inference_latency_ms"]
        elif "timings" in data:
            engine_ms = data["timings"]["prompt_ms"] + data["timings"]["predicted_ms"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None and "timings" in data:
            cached = data["timings"].get("cache_n")
        return CallSample(
            client_ms=client_ms,
            engine_ms=engine_ms,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=cached,
            completion_tokens=usage.get("completion_tokens"),
            text=data["choices"][0]["message"].get("content") or "",
        )

    def stream(self, max_tokens: int, client: httpx.Client | None = None) -> StreamSample:
        clock = StreamClock()
        usage: dict[str, Any] | None = None
        finish = None
        extra: dict[str, Any] = {}
        with (client or self.client).stream(
            "POST", f"{self.base_url}/v1/chat/completions", json=self._body(max_tokens, True)
        ) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"POST /v1/chat/completions: {response.status_code} {response.text[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    clock.content((choice.get("delta") or {}).get("content"))
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
                if "hypnos_telemetry" in chunk:
                    engine = chunk["hypnos_telemetry"].get("engine") or {}
                    extra = {
                        "engine_ttft_ms": engine.get("ttft_ms"),
                        "engine_decode_tokens_per_s": engine.get("decode_tokens_per_s"),
                        "concurrent_slots": engine.get("concurrent_slots"),
                    }
                elif chunk.get("timings"):
                    timings = chunk["timings"]
                    extra = {
                        "engine_ttft_ms": timings.get("prompt_ms"),
                        "engine_decode_tokens_per_s": timings.get("predicted_per_second"),
                    }
        # Usage where the server streams it (Hypnos, llama-server): the distributed deployment
        # joins deltas, so chunks undercount. llama_cpp.server sends one chunk per token, no usage.
        tokens = int(usage["completion_tokens"]) if usage else clock.chunks
        prompt = int(usage["prompt_tokens"]) if usage else None
        return _stream_sample(clock, tokens, prompt, finish, **extra)

    def concurrent(self, streams: int, max_tokens: int) -> ConcurrentSample:
        """`streams` streamed calls at once, each on its own connection."""
        barrier = threading.Barrier(streams)
        results: list[StreamSample | BaseException | None] = [None] * streams
        clients = [httpx.Client(timeout=REQUEST_TIMEOUT_SECS) for _ in range(streams)]

        def one(index: int) -> None:
            try:
                barrier.wait()
                results[index] = self.stream(max_tokens, clients[index])
            except BaseException as exc:  # reported below
                results[index] = exc

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(REQUEST_TIMEOUT_SECS)
        finally:
            for client in clients:
                client.close()
        errors = [r for r in results if not isinstance(r, StreamSample)]
        if errors:
            raise RuntimeError(f"{len(errors)} of {streams} concurrent streams failed: {errors[0]!r}")
        done = [r for r in results if isinstance(r, StreamSample)]
        wall = max(s.last_at for s in done) - min(s.started_at for s in done)
        tokens = sum(s.completion_tokens for s in done)
        return ConcurrentSample(
            aggregate_tokens_per_s=tokens / wall if wall > 0 else 0.0,
            wall_ms=wall * 1000,
            completion_tokens=tokens,
            streams=done,
        )


def start_process(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    """Start ARGS (any program), its output to LOG_DIR/NAME.log, in a session of its own."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as out:
        popen = subprocess.Popen(
            args,
            cwd=BASE_DIR,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    log.info("%s started (pid %d): %s", name, popen.pid, " ".join(args))
    return Proc(name, popen, log_path)


def wait_ready(url: str, procs: list[Proc]) -> float:
    """Poll GET `url` until 200; the seconds it took. Fails when a process exits."""
    started = time.monotonic()
    last = "no answer"
    while time.monotonic() < started + READY_TIMEOUT_SECS:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return time.monotonic() - started
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {READY_TIMEOUT_SECS:g} s (last: {last})")


@contextmanager
def serving(
    name: str,
    procs_to_start: list[tuple[str, list[str], dict[str, str]]],
    ready_path: str,
    port: int,
    log_dir: Path,
    after_stop: Callable[[], None] | None = None,
) -> Iterator[HttpTarget]:
    """Start the processes, wait for `ready_path`, yield the target; stop them all (the last
    started first) however the block ends."""
    procs: list[Proc] = []
    target = None
    try:
        for proc_name, args, env in procs_to_start:
            procs.append(start_process(proc_name, args, env, log_dir))
        base_url = f"http://127.0.0.1:{port}"
        secs = wait_ready(base_url + ready_path, procs)
        log.info("%s: ready after %.1f s on %s", name, secs, base_url)
        target = HttpTarget(name, base_url, procs)
        yield target
    except BaseException:
        for proc in procs:
            log.error("%s output (last lines):\n%s", proc.name, proc.tail())
        raise
    finally:
        if target is not None:
            target.close()
        for proc in reversed(procs):
            proc.stop()
        if after_stop is not None:
            after_stop()


def llama_cpp_server(python: Path, settings: Settings, log_dir: Path) -> Any:
    """`python -m llama_cpp.server` on the GGUF, same context and threads. interrupt_requests is
    off: by default a new request ends the stream in progress, which would cut the concurrent
    round short (the server has one model instance and a lock: no slots)."""
    port = free_port()
    args = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(settings.weights),
        "--model_alias",
        MODEL_ID,
        "--n_ctx",
        str(CONTEXT_LEN),
        "--n_threads",
        str(settings.threads),
        "--n_threads_batch",
        str(settings.threads),
        "--n_gpu_layers",
        "0",
        "--interrupt_requests",
        "False",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    return serving("llama_cpp_server", [("llama_cpp_server", args, env)], "/v1/models", port, log_dir)


def llama_server(binary: Path, settings: Settings, slots: int, log_dir: Path) -> Any:
    """llama.cpp's `llama-server`: the same context for all its slots together (`-kvu`, as
    Hypnos's slots share one unified KV cache of context_len), same threads, its defaults
    otherwise (what its users get)."""
    port = free_port()
    args = [
        str(binary),
        "-m",
        str(settings.weights),
        "-c",
        str(CONTEXT_LEN),
        "-t",
        str(settings.threads),
        "-tb",
        str(settings.threads),
        "-np",
        str(slots),
        "-ngl",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if slots > 1:
        args.append("--kv-unified")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    return serving("llama_server", [(f"llama_server-np{slots}", args, env)], "/health", port, log_dir)


def write_hypnos_config(directory: Path, weights: Path, threads: int, slots: int) -> Path:
    """One chat model (absolute weights path), `slots` slots, the benchmark's threads."""
    path = directory / "hypnos.toml"
    path.write_text(
        f"""\
[hardware]
n_threads = {threads}

[[models]]
id = "{MODEL_ID}"
modality = "text_generation"
engine = "ggml_llama"
weights_path = {json.dumps(str(weights.resolve()))}
context_len = {CONTEXT_LEN}
slots = {slots}
initial_tier = "tier1_gpu_vram"
"""
    )
    return path


def hypnos(deployment: str, settings: Settings, slots: int, work_dir: Path, redis_url: str | None) -> Any:
    """Hypnos in one deployment, its own config, data dir and port (chat_stream.py's set-up)."""
    data_dir = work_dir / f"{deployment}-slots{slots}"
    data_dir.mkdir()
    config = write_hypnos_config(data_dir, settings.weights, settings.threads, slots)
    port = free_port()
    env = server_env(deployment, config, data_dir, port)
    if deployment == "distributed" and redis_url:
        env["HYPNOS_REDIS_URL"] = redis_url
    migrate(env)
    procs = []
    if deployment == "distributed":
        procs.append(("runinference", [sys.executable, "manage.py", "runinference"], env))
    procs.append((f"serve-{deployment}", [sys.executable, "-m", "hypnos_site.serve"], env))
    after = (lambda: _clear_redis(env["HYPNOS_CHANNEL_PREFIX"])) if deployment == "distributed" else None
    return serving(deployment, procs, "/ready", port, data_dir, after)


@contextmanager
def redis_for_benchmark(work_dir: Path) -> Iterator[str]:
    """chat_stream.py's Redis (127.0.0.1:6379) when it answers, else a private redis-server on a
    free port for the run (no persistence), stopped afterwards."""
    import redis
    from chat_stream import REDIS_URL

    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
        yield REDIS_URL
        return
    except redis.RedisError:
        pass
    port = free_port()
    proc = start_process(
        "redis",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        dict(os.environ),
        work_dir,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or proc.popen.poll() is not None:
                    raise RuntimeError(f"redis-server did not start:\n{proc.tail()}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.stop()


# -- the run -------------------------------------------------------------------------------------


def measure_single_slot(target: Any, sampler: Sampler, settings: Settings) -> None:
    """(a), (b), (c) after one warm-up of each kind (not counted: it loads the prompt into the
    cache). The quick calls wait for a quiet machine once per series, the streams before each."""
    sampler._with_retries(target.call, f"{target.name} warm-up")
    sampler._with_retries(lambda: target.stream(settings.max_tokens), f"{target.name} warm-up")
    sampler.run("call", target.call, settings.calls, quiet_each=False)
    sampler.run("ttft", lambda: target.stream(settings.ttft_max_tokens), settings.calls, quiet_each=False)
    sampler.run("decode", lambda: target.stream(settings.max_tokens), settings.runs)


def measure_slots(target: HttpTarget, sampler: Sampler, settings: Settings) -> None:
    """On the server with SLOTS slots: single streams before, (d) rounds of SLOTS concurrent
    streams, (e) single streams right after, and again after the server sat idle."""
    stream = lambda: target.stream(settings.max_tokens)  # noqa: E731
    sampler._with_retries(stream, f"{target.name} warm-up")
    sampler.run("before", stream, settings.runs)
    sampler.run("concurrent", lambda: target.concurrent(SLOTS, settings.max_tokens), settings.runs)
    sampler.run("after", stream, settings.runs)
    first = sampler.result.series["after"].samples[0]
    log.info(
        "%s: the first single stream after the concurrent rounds: %.1f tok/s", target.name, first.decode_tokens_per_s
    )
    log.info("%s: idle for %g s", target.name, settings.idle_secs)
    time.sleep(settings.idle_secs)
    sampler.run("after_idle", stream, settings.runs)


def bench_target(
    name: str, settings: Settings, peers: dict[str, Any], work_dir: Path, redis_url: str | None
) -> TargetResult:
    result = TargetResult(name)
    log_dir = work_dir / name
    log_dir.mkdir()
    if name == "raw":
        raw = RawTarget(settings)
        try:
            measure_single_slot(raw, Sampler(settings, result, lambda: [os.getpid()]), settings)
        finally:
            raw.close()
        result.notes.append("raw: no server, so no slots; (d) and (e) are not measured")
        return result
    if name == "llama_cpp_server":
        result.info = peers["llama_cpp_server"]
        with llama_cpp_server(Path(result.info["python"]), settings, log_dir) as target:
            sampler = Sampler(settings, result, target.pids)
            measure_single_slot(target, sampler, settings)
            measure_slots(target, sampler, settings)
        result.notes.append(
            "llama_cpp_server: no slots (one Llama behind a lock): its 4 concurrent streams run one after another"
        )
        return result
    result.slots = SLOTS
    if name == "llama_server":
        result.info = peers["llama_server"]
        binary = Path(result.info["path"])
        single = llama_server(binary, settings, 1, log_dir)
        multi = llama_server(binary, settings, SLOTS, log_dir)
    else:
        single = hypnos(name, settings, 1, log_dir, redis_url)
        multi = hypnos(name, settings, SLOTS, log_dir, redis_url)
    with single as target:
        measure_single_slot(target, Sampler(settings, result, target.pids), settings)
    with multi as target:
        measure_slots(target, Sampler(settings, result, target.pids), settings)
    return result


def setup_peers(targets: list[str]) -> dict[str, Any]:
    """Build or find in the cache what the peer targets need, before anything is measured."""
    peers: dict[str, Any] = {}
    if "llama_cpp_server" in targets:
        python, info = llama_cpp_server_python()
        peers["llama_cpp_server"] = {**info, "python": str(python)}
    if "llama_server" in targets:
        binary, info = llama_server_binary()
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        peers["llama_server"] = {**info, "binary_version": (done.stdout + done.stderr).strip().splitlines()[-2:]}
    return peers


# -- report --------------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def summary(results: list[TargetResult]) -> list[dict[str, Any]]:
    """One row per target: the p50 of every measurement."""
    rows = []
    for r in results:
        series = r.series
        tokens = sorted(
            {
                s.completion_tokens
                for name in ("decode", "before", "after")
                if name in series
                for s in series[name].samples
            }
        )
        prompts = (
            sorted({s.prompt_tokens for s in series["call"].samples if s.prompt_tokens is not None})
            if "call" in series
            else []
        )
        rows.append(
            {
                "target": r.target,
                "call_client_ms": r.p50("call", "client_ms"),
                "call_engine_ms": r.p50("call", "engine_ms"),
                "call_above_engine_ms": r.p50("call", "above_engine_ms"),
                "ttft_ms": r.p50("ttft", "ttft_ms"),
                "decode_tokens_per_s": r.p50("decode", "decode_tokens_per_s"),
                "engine_decode_tokens_per_s": r.p50("decode", "engine_decode_tokens_per_s"),
                "slots": r.slots,
                "before_tokens_per_s": r.p50("before", "decode_tokens_per_s"),
                "concurrent_aggregate_tokens_per_s": r.p50("concurrent", "aggregate_tokens_per_s"),
                "after_tokens_per_s": r.p50("after", "decode_tokens_per_s"),
                "after_first_tokens_per_s": (
                    series["after"].samples[0].decode_tokens_per_s if "after" in series else None
                ),
                "after_idle_tokens_per_s": r.p50("after_idle", "decode_tokens_per_s"),
                "prompt_tokens": prompts,
                "completion_tokens": tokens,
                "disturbed_samples": sum(s.disturbed() for s in series.values()),
                "discarded_samples": sum(len(s.discarded) for s in series.values()),
                "failed_requests": len(r.failures),
            }
        )
    return rows


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets for each Hypnos deployment that ran, against the peers that ran."""
    by = {row["target"]: row for row in rows}
    peer_lcs, peer_ls = by.get("llama_cpp_server"), by.get("llama_server")
    out = []

    def check(
        deployment: str,
        what: str,
        value: float | None,
        reference: float | None,
        ratio: float | None,
        op: str,
        limit: float,
        absolute: bool = False,
    ) -> None:
        # (a)'s target is the value itself; the others are ratios to a reference (None: the
        # reference did not run, and the check says "-").
        measured = value if absolute else ratio
        ok = None if measured is None else (measured <= limit if op == "<=" else measured >= limit)
        out.append(
            {
                "deployment": deployment,
                "check": what,
                "value": value,
                "reference": reference,
                "ratio": ratio,
                "target": f"{op} {limit:g}",
                "pass": ok,
            }
        )

    for deployment in HYPNOS_TARGETS:
        row = by.get(deployment)
        if row is None:
            continue
        check(
            deployment,
            "(a) server ms above the engine, p50, non-streamed max_tokens 1",
            row["call_above_engine_ms"],
            None,
            None,
            "<=",
            TARGET_OVERHEAD_MS,
            absolute=True,
        )
        ref = peer_lcs["ttft_ms"] if peer_lcs else None
        check(
            deployment,
            "(b) TTFT p50 ms / llama_cpp.server's",
            row["ttft_ms"],
            ref,
            _ratio(row["ttft_ms"], ref),
            "<=",
            TARGET_TTFT_VS_LLAMA_CPP_SERVER,
        )
        ref = peer_ls["decode_tokens_per_s"] if peer_ls else None
        check(
            deployment,
            "(c) streamed decode tok/s / llama-server's",
            row["decode_tokens_per_s"],
            ref,
            _ratio(row["decode_tokens_per_s"], ref),
            ">=",
            TARGET_DECODE_VS_LLAMA_SERVER[deployment],
        )
        ref = peer_ls["concurrent_aggregate_tokens_per_s"] if peer_ls else None
        check(
            deployment,
            f"(d) {SLOTS} streams aggregate tok/s / llama-server's, {SLOTS} slots",
            row["concurrent_aggregate_tokens_per_s"],
            ref,
            _ratio(row["concurrent_aggregate_tokens_per_s"], ref),
            ">=",
            TARGET_AGGREGATE_VS_LLAMA_SERVER,
        )
        check(
            deployment,
            f"(e) single stream after (d) / before (d), {SLOTS}-slot model",
            row["after_tokens_per_s"],
            row["before_tokens_per_s"],
            _ratio(row["after_tokens_per_s"], row["before_tokens_per_s"]),
            ">=",
            TARGET_AFTER_VS_BEFORE,
        )
    return out


def _table(header: list[str], body: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` ones flush left, the rest right."""
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return " | ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(cells) for cells in body)])


def render_figures(rows: list[dict[str, Any]]) -> str:
    header = [
        "target",
        "(a) p50 ms",
        "engine ms",
        "above engine",
        "(b) TTFT ms",
        "(c) tok/s",
        "slots",
        "before tok/s",
        "(d) aggr tok/s",
        "(e) after tok/s",
        "after idle",
    ]
    body = [
        [
            row["target"],
            _fmt(row["call_client_ms"], 2),
            _fmt(row["call_engine_ms"], 2),
            _fmt(row["call_above_engine_ms"], 2),
            _fmt(row["ttft_ms"], 2),
            _fmt(row["decode_tokens_per_s"]),
            "-" if row["target"] == "raw" else ("none" if row["slots"] is None else str(row["slots"])),
            _fmt(row["before_tokens_per_s"]),
            _fmt(row["concurrent_aggregate_tokens_per_s"]),
            _fmt(row["after_tokens_per_s"]),
            _fmt(row["after_idle_tokens_per_s"]),
        ]
        for row in rows
    ]
    return _table(header, body)


def render_checks(rows: list[dict[str, Any]]) -> str:
    header = ["deployment", "check", "value", "reference", "ratio", "target", "result"]
    body = [
        [
            row["deployment"],
            row["check"],
            _fmt(row["value"], 2),
            _fmt(row["reference"], 2),
            _fmt(row["ratio"], 2),
            row["target"],
            {True: "pass", False: "FAIL", None: "-"}[row["pass"]],
        ]
        for row in rows
    ]
    return _table(header, body, left=2)


def write_json(
    path: Path,
    settings: Settings,
    results: list[TargetResult],
    rows: list[dict[str, Any]],
    check_rows: list[dict[str, Any]],
    machine: dict[str, Any],
) -> None:
    document = {
        "benchmark": "bench/server_cost.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            "model_id": MODEL_ID,
            "messages": MESSAGES,
            "temperature": 0.0,
            "context_len": CONTEXT_LEN,
            "slots": SLOTS,
        },
        "machine": machine,
        "summary": rows,
        "checks": check_rows,
        "targets": {
            r.target: {
                "info": r.info,
                "notes": r.notes,
                "failures": r.failures,
                "series": {
                    name: {
                        "samples": [asdict(s) for s in series.samples],
                        "discarded": [asdict(s) for s in series.discarded],
                    }
                    for name, series in r.series.items()
                },
            }
            for r in results
        },
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    log.info("wrote %s", path)


def machine_info() -> dict[str, Any]:
    import llama_cpp

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "llama_cpp_python": llama_cpp.__version__,
        "loadavg": os.getloadavg(),
    }


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=TARGETS, help="run only this target (repeatable)")
    parser.add_argument(
        "--runs", type=int, default=5, help="streams per measurement (c, e) and rounds of (d) (default 5)"
    )
    parser.add_argument("--calls", type=int, default=21, help="samples of (a) and of (b) (default 21)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of each decode stream (default 128)")
    parser.add_argument("--ttft-max-tokens", type=int, default=4, help="max_tokens of the TTFT streams (default 4)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="engine threads of every target (default: every core)"
    )
    parser.add_argument(
        "--idle-secs",
        type=float,
        default=IDLE_AFTER_CONCURRENT_SECS,
        help=f"how long the {SLOTS}-slot server sits idle before the last single streams "
        f"(default {IDLE_AFTER_CONCURRENT_SECS:g})",
    )
    parser.add_argument("--retries", type=int, default=2, help="times a failed request is sent again (default 2)")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="SECS",
        help=f"wait up to SECS for the CPU to be >= {QUIET_IDLE_PCT:g}%% idle before a "
        "measurement (default 30; 0: do not wait)",
    )
    parser.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=10.0,
        metavar="PCT",
        help="a sample during which other processes took more than PCT%% of the CPU is measured again (default 10)",
    )
    parser.add_argument(
        "--redo",
        type=int,
        default=None,
        metavar="N",
        help="at most N disturbed samples per measurement are measured again (default: --runs)",
    )
    parser.add_argument("--setup-only", action="store_true", help="build or find the peers in the cache, then stop")
    parser.add_argument("--json", type=Path, help="also write every sample and the summary to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.redo is None:
        args.redo = args.runs
    if (
        min(args.runs, args.calls, args.threads, args.ttft_max_tokens) < 1
        or args.max_tokens < 2
        or min(args.retries, args.wait_idle, args.redo, args.idle_secs) < 0
    ):
        parser.error(
            "--runs, --calls, --threads, --ttft-max-tokens >= 1, --max-tokens >= 2, "
            "--retries, --wait-idle, --redo, --idle-secs >= 0"
        )
    return args


def model_weights() -> Path:
    """The suite's SmolLM2-135M GGUF, as the configuration places it."""
    cfg = load_config()
    model = next((m for m in cfg.models if m.id == MODEL_ID), cfg.models[0])
    return cfg.weights_file(model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from chat_stream import _stop_on_sigterm

    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    targets = [t for t in TARGETS if t in (args.only or TARGETS)]
    peers = setup_peers(targets)
    if args.setup_only:
        print(json.dumps(peers, indent=2))
        return 0
    weights = model_weights()
    if not weights.exists():
        log.error("the model file %s is missing; run ./run.sh setup first", weights)
        return 1
    settings = Settings(
        weights=weights,
        threads=args.threads,
        max_tokens=args.max_tokens,
        ttft_max_tokens=args.ttft_max_tokens,
        runs=args.runs,
        calls=args.calls,
        retries=args.retries,
        wait_idle_secs=args.wait_idle,
        max_foreign_cpu_pct=args.max_foreign_cpu,
        redo=args.redo,
        idle_secs=args.idle_secs,
    )
    machine = machine_info()
    idle = cpu_idle_pct()
    log.info(
        "targets %s; %d threads; load average %s; %s%% idle now",
        targets,
        settings.threads,
        machine["loadavg"],
        _fmt(idle, 0),
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="hypnos-server-cost-") as tmp:
        work_dir = Path(tmp)
        with contextlib_redis(work_dir, "distributed" in targets) as redis_url:
            for name in targets:
                results.append(bench_target(name, settings, peers, work_dir, redis_url))
    machine["loadavg_end"] = os.getloadavg()
    rows = summary(results)
    check_rows = checks(rows)
    print(
        f"SmolLM2-135M-Instruct ({weights.name}), {settings.threads} threads, greedy, warm prompt; "
        f"(a)/(b) {settings.calls} samples, (b) max_tokens {settings.ttft_max_tokens}, (c)-(e) {settings.runs} "
        f"x {settings.max_tokens} tokens, (d) {SLOTS} streams; load average {machine['loadavg'][0]:.2f} at the "
        f"start, {machine['loadavg_end'][0]:.2f} at the end"
    )
    print(render_figures(rows))
    print()
    print(render_checks(check_rows))
    for result in results:
        for note in result.notes:
            print(f"note: {note}")
    print(
        "tokens: "
        + "; ".join(
            f"{row['target']} {row['prompt_tokens']} prompt + {row['completion_tokens']} completion" for row in rows
        )
    )
    print(
        "samples disturbed by other processes (kept / redone): "
        + ", ".join(f"{row['target']} {row['disturbed_samples']}/{row['discarded_samples']}" for row in rows)
        + "; failed requests (retried): "
        + ", ".join(f"{row['target']} {row['failed_requests']}" for row in rows)
    )
    if args.json:
        write_json(args.json, settings, results, rows, check_rows, machine)
    return 0


@contextmanager
def contextlib_redis(work_dir: Path, needed: bool) -> Iterator[str | None]:
    if not needed:
        yield None
        return
    with redis_for_benchmark(work_dir) as url:
        yield url


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; every server this run started has been stopped")
        sys.exit(130)
