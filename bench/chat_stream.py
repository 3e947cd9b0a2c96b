"""Streamed chat benchmark: Hypnos (embedded and distributed) against raw llama-cpp-python.

Measures time to first token (TTFT) and streamed decode tokens/s for the default chat model
(SmolLM2-135M-Instruct) on one prompt, greedy, with one seed:

- ``raw``: ``llama_cpp.Llama.create_chat_completion(stream=True)`` in this process;
- ``embedded``: ``python -m hypnos_site.serve`` with ``HYPNOS_DEPLOYMENT=embedded``;
- ``distributed``: ``python -m hypnos_site.serve`` + ``manage.py runinference`` over Redis.

Only one target runs at a time (each server is stopped before the next starts; raw runs while
no server runs). Each target gets one warm-up request, then ``--runs`` measured ones; the table
shows medians and the server / raw ratios. bench/README.md describes the method.

    .venv/bin/python bench/chat_stream.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402

from hypnos_site.config import load_config  # noqa: E402

log = logging.getLogger("bench.chat_stream")

TARGETS = ("raw", "embedded", "distributed")
MODEL_ID = "smollm2-135m"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a long story about a dragon."},
]
CONTEXT_LEN = 4096
READY_TIMEOUT_SECS = 120.0
STOP_TIMEOUT_SECS = 10.0
REQUEST_TIMEOUT_SECS = 300.0
REDIS_URL = "redis://127.0.0.1:6379/0"
# A run starts on a "quiet" machine when at least this share of all CPU time was idle just before.
QUIET_IDLE_PCT = 80.0
IDLE_WINDOW_SECS = 0.5
PROC = Path("/proc")


@dataclass(frozen=True)
class BenchSettings:
    """What every target is run with."""

    weights: Path
    threads: int
    max_tokens: int
    seed: int
    runs: int
    retries: int
    wait_idle_secs: float
    max_foreign_cpu_pct: float
    redo: int


@dataclass
class RunResult:
    """One measured (or warm-up) request."""

    ttft_ms: float
    decode_tokens_per_s: float
    completion_tokens: int
    prompt_tokens: int | None
    text: str
    total_ms: float
    content_chunks: int
    finish_reason: str | None = None
    server_ttft_ms: float | None = None
    server_decode_tokens_per_s: float | None = None
    idle_before_pct: float | None = None
    foreign_cpu_pct: float | None = None
    disturbed: bool = False


@dataclass
class TargetResult:
    """Every run of one target and its medians."""

    target: str
    runs: list[RunResult] = field(default_factory=list)
    warmup: RunResult | None = None
    failures: list[str] = field(default_factory=list)
    # Runs disturbed by other processes and measured again in their place.
    discarded: list[RunResult] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.runs if getattr(r, name) is not None]
        return statistics.median(values) if values else None

    def disturbed_runs(self) -> int:
        """Kept runs during which other processes used more CPU than allowed."""
        return sum(1 for r in self.runs if r.disturbed)


# -- machine load --------------------------------------------------------------------------------


def cpu_idle_pct(window_secs: float = IDLE_WINDOW_SECS) -> float | None:
    """Share of all CPU time that was idle over the next `window_secs` (Linux /proc/stat);
    None where that file cannot be read."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, all

    try:
        idle0, total0 = sample()
        time.sleep(window_secs)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 100.0 * (idle1 - idle0) / max(total1 - total0, 1)


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine since boot, in clock ticks."""
    with open(PROC / "stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]  # user .. steal
    return sum(values) - values[3] - values[4], sum(values)


def _process_jiffies(pid: int) -> int:
    """utime + stime of one process (all its threads), in clock ticks; 0 once it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def redis_server_pids() -> list[int]:
    """The redis-server processes: their work is part of the distributed target's."""
    pids = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "redis-server":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class CpuMeter:
    """CPU used by processes other than the measured ones, during one run, as a share of the
    whole machine's CPU time (100 = every core busy with something else)."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self._start: tuple[int, int, int] | None = None

    def _sample(self) -> tuple[int, int, int]:
        busy, total = _machine_jiffies()
        return busy, total, sum(_process_jiffies(pid) for pid in self.pids)

    def start(self) -> None:
        try:
            self._start = self._sample()
        except (OSError, ValueError, IndexError):
            self._start = None

    def foreign_pct(self) -> float | None:
        """Since `start`; None where /proc cannot be read."""
        if self._start is None:
            return None
        try:
            busy, total, ours = self._sample()
        except (OSError, ValueError, IndexError):
            return None
        busy0, total0, ours0 = self._start
        foreign = (busy - busy0) - (ours - ours0)
        return max(0.0, 100.0 * foreign / max(total - total0, 1))


def wait_until_quiet(max_wait_secs: float, label: str) -> float | None:
    """Wait up to `max_wait_secs` for a quiet machine (other processes compete for the few
    cores and make single runs many times slower); the idle share last seen."""
    deadline = time.monotonic() + max_wait_secs
    idle = cpu_idle_pct()
    while idle is not None and idle < QUIET_IDLE_PCT and time.monotonic() < deadline:
        idle = cpu_idle_pct()
    if idle is not None and idle < QUIET_IDLE_PCT:
        log.warning("%s starts on a busy machine (%.0f%% idle); its figures will be noisy", label, idle)
    return idle


# -- measuring a stream --------------------------------------------------------------------------


class StreamClock:
    """Timestamps of a token stream: first and last non-empty content, from the request's start."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.parts: list[str] = []

    def content(self, text: str | None) -> None:
        """Record one content delta; empty ones (the role chunk, the final chunk) do not count."""
        if not text:
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.chunks += 1
        self.parts.append(text)

    def result(self, completion_tokens: int, prompt_tokens: int | None, **extra: Any) -> RunResult:
        """TTFT = first content - start; decode tok/s = (tokens - 1) / (last - first content)."""
        ended = time.perf_counter()
        if self.first is None or self.last is None:
            raise RuntimeError("the stream carried no content")
        span = self.last - self.first
        rate = (completion_tokens - 1) / span if span > 0 and completion_tokens > 1 else 0.0
        return RunResult(
            ttft_ms=(self.first - self.started) * 1000,
            decode_tokens_per_s=rate,
            completion_tokens=completion_tokens,
            prompt_tokens=prompt_tokens,
            text="".join(self.parts),
            total_ms=(ended - self.started) * 1000,
            content_chunks=self.chunks,
            **extra,
        )


def measure_runs(
    result: TargetResult,
    settings: BenchSettings,
    request: Callable[[], RunResult],
    pids: list[int],
    retries: int = 0,
) -> None:
    """The warm-up and the measured runs of one target. Each run waits for a quiet machine
    first; a run during which other processes (not `pids`) took more than
    `max_foreign_cpu_pct` of the CPU is discarded and measured again, `redo` times at most."""
    result.warmup = _with_retries(request, f"{result.target} warm-up", retries, result.failures)
    log.info("%s warm-up: %s", result.target, _describe(result.warmup))
    meter = CpuMeter(pids)
    while len(result.runs) < settings.runs:
        label = f"{result.target} run {len(result.runs) + 1}/{settings.runs}"
        idle = wait_until_quiet(settings.wait_idle_secs, label)
        meter.start()
        run = _with_retries(request, label, retries, result.failures)
        run.idle_before_pct, run.foreign_cpu_pct = idle, meter.foreign_pct()
        run.disturbed = run.foreign_cpu_pct is not None and run.foreign_cpu_pct > settings.max_foreign_cpu_pct
        log.info("%s: %s", label, _describe(run))
        if run.disturbed and len(result.discarded) < settings.redo:
            log.warning(
                "%s: other processes took %.0f%% of the CPU meanwhile; measuring it again", label, run.foreign_cpu_pct
            )
            result.discarded.append(run)
            continue
        result.runs.append(run)


def _with_retries(request: Callable[[], RunResult], label: str, retries: int, failures: list[str]) -> RunResult:
    """Run `request`; a failed one (an HTTP error, a broken stream) is noted in `failures` and
    sent again, up to `retries` more times. Failures are reported in the output, never hidden."""
    for attempt in range(retries + 1):
        try:
            return request()
        except (RuntimeError, httpx.HTTPError) as exc:
            failures.append(f"{label}: {exc}")
            if attempt == retries:
                raise
            log.warning("%s failed (%s); retrying (%d/%d)", label, exc, attempt + 1, retries)
    raise AssertionError("unreachable")


def _describe(run: RunResult) -> str:
    load = ""
    if run.idle_before_pct is not None:
        load += f", {run.idle_before_pct:.0f}% idle before"
    if run.foreign_cpu_pct is not None:
        load += f", others {run.foreign_cpu_pct:.0f}% CPU during"
    return (
        f"TTFT {run.ttft_ms:.1f} ms, {run.decode_tokens_per_s:.1f} tok/s, "
        f"{run.completion_tokens} tokens in {run.content_chunks} chunks, finish {run.finish_reason}{load}"
    )


# -- raw llama-cpp-python ------------------------------------------------------------------------


def bench_raw(settings: BenchSettings) -> TargetResult:
    """Load the GGUF in this process, as the server's engine does, and stream the request."""
    import llama_cpp

    result = TargetResult("raw")
    log.info("raw: loading %s with %d threads", settings.weights, settings.threads)
    llm = llama_cpp.Llama(
        model_path=str(settings.weights),
        n_ctx=CONTEXT_LEN,
        n_threads=settings.threads,
        n_threads_batch=settings.threads,
        n_gpu_layers=0,
        verbose=False,
    )
    try:
        prompt_tokens, completion_tokens = _raw_usage(llm, settings)
        measure_runs(result, settings, lambda: _raw_stream(llm, settings, prompt_tokens), [os.getpid()])
    finally:
        llm.close()
    for run in result.runs:
        if run.completion_tokens != completion_tokens:
            log.warning(
                "raw: a streamed run had %d content chunks but the non-streamed usage says %d completion "
                "tokens; the raw token count is off",
                run.completion_tokens,
                completion_tokens,
            )
    return result


def _raw_usage(llm: Any, settings: BenchSettings) -> tuple[int, int]:
    """One non-streamed request (not measured): the prompt and completion token counts that
    llama-cpp-python reports, which the streamed API does not."""
    llm.reset()
    response = llm.create_chat_completion(
        messages=MESSAGES, stream=False, max_tokens=settings.max_tokens, temperature=0.0, seed=settings.seed
    )
    usage = response["usage"]
    log.info("raw usage: %d prompt tokens, %d completion tokens", usage["prompt_tokens"], usage["completion_tokens"])
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


def _raw_stream(llm: Any, settings: BenchSettings, prompt_tokens: int) -> RunResult:
    """One streamed request. The context is reset first, as the server's engine does for a
    seeded request, so the whole prompt is evaluated every time (no prefix reuse)."""
    llm.reset()
    clock = StreamClock()
    finish = None
    for chunk in llm.create_chat_completion(
        messages=MESSAGES, stream=True, max_tokens=settings.max_tokens, temperature=0.0, seed=settings.seed
    ):
        choice = chunk["choices"][0]
        clock.content(choice["delta"].get("content"))
        finish = choice.get("finish_reason") or finish
    # llama-cpp-python streams one content chunk per generated token (checked against usage).
    return clock.result(clock.chunks, prompt_tokens, finish_reason=finish)


# -- the Hypnos server ---------------------------------------------------------------------------


@dataclass
class Proc:
    """A server process started by the benchmark, with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        """The last lines of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_SECS."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %g s; killing it", self.name, STOP_TIMEOUT_SECS)
                self.popen.kill()
                self.popen.wait()


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_config(directory: Path, weights: Path, threads: int) -> Path:
    """A config with the one chat model (absolute weights path) and the benchmark's threads."""
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
initial_tier = "tier1_gpu_vram"
"""
    )
    return path


def server_env(deployment: str, config: Path, data_dir: Path, port: int) -> dict[str, str]:
    """This process's environment without any HYPNOS_* variable, plus the benchmark's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    env.update(
        HYPNOS_CONFIG=str(config),
        HYPNOS_DATA_DIR=str(data_dir),
        HYPNOS_PORT=str(port),
        HYPNOS_HOST="127.0.0.1",
        HYPNOS_DEPLOYMENT=deployment,
        DJANGO_SETTINGS_MODULE="hypnos_site.settings",
    )
    if deployment == "distributed":
        env.update(
            HYPNOS_REDIS_URL=REDIS_URL,
            HYPNOS_CHANNEL_PREFIX="hypnos-bench-" + secrets.token_hex(4),
            HYPNOS_DATABASE_URL=f"sqlite:///{data_dir / 'hypnos.sqlite3'}",
        )
    return env


def start_proc(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    """Start `python ARGS` in the repository root, its output to LOG_DIR/NAME.log."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, *args],
            cwd=BASE_DIR,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches only the benchmark, which stops it
        )
    log.info("%s started (pid %d), log %s", name, popen.pid, log_path)
    return Proc(name, popen, log_path)


def migrate(env: dict[str, str]) -> None:
    """`manage.py migrate` on the benchmark's own database."""
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "-v0"],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py migrate failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def wait_ready(base_url: str, procs: list[Proc]) -> float:
    """Poll GET /ready until 200; the seconds it took. Fails when a process exits."""
    started = time.monotonic()
    deadline = started + READY_TIMEOUT_SECS
    last = "no answer"
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            response = httpx.get(f"{base_url}/ready", timeout=5)
            if response.status_code == 200:
                return time.monotonic() - started
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"not ready within {READY_TIMEOUT_SECS:g} s (last: {last})")


@contextmanager
def running_server(deployment: str, settings: BenchSettings, work_dir: Path) -> Iterator[tuple[str, list[int]]]:
    """Start one deployment of the server; yield its base URL and the ids of the processes that
    serve it; stop every process it started."""
    data_dir = work_dir / deployment
    data_dir.mkdir()
    config = write_config(data_dir, settings.weights, settings.threads)
    port = free_port()
    env = server_env(deployment, config, data_dir, port)
    migrate(env)
    procs: list[Proc] = []
    try:
        if deployment == "distributed":
            procs.append(start_proc("runinference", ["manage.py", "runinference"], env, data_dir))
        procs.append(start_proc(f"serve-{deployment}", ["-m", "hypnos_site.serve"], env, data_dir))
        base_url = f"http://127.0.0.1:{port}"
        secs = wait_ready(base_url, procs)
        log.info("%s: ready after %.1f s on %s", deployment, secs, base_url)
        yield base_url, [proc.popen.pid for proc in procs]
    except BaseException:
        for proc in procs:
            log.error("%s output (last lines):\n%s", proc.name, proc.tail())
        raise
    finally:
        for proc in reversed(procs):  # the web process first, then the worker
            proc.stop()
        if deployment == "distributed":
            _clear_redis(env["HYPNOS_CHANNEL_PREFIX"])


def _clear_redis(prefix: str) -> None:
    """Delete what the run left in Redis under its own channel prefix (best effort)."""
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    except Exception as exc:  # the keys expire on their own anyway
        log.debug("could not clear Redis keys %s*: %s", prefix, exc)


def server_stream(client: httpx.Client, base_url: str, settings: BenchSettings) -> RunResult:
    """One streamed POST /v1/chat/completions; usage and telemetry come from the final chunk."""
    body = {
        "model": MODEL_ID,
        "messages": MESSAGES,
        "max_tokens": settings.max_tokens,
        "temperature": 0,
        "seed": settings.seed,
        "stream": True,
    }
    clock = StreamClock()
    final: dict[str, Any] | None = None
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"POST /v1/chat/completions: {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            clock.content(chunk["choices"][0]["delta"].get("content"))
            if "usage" in chunk:
                final = chunk
    if final is None:
        raise RuntimeError("the stream had no final chunk with usage")
    engine = (final.get("hypnos_telemetry") or {}).get("engine") or {}
    return clock.result(
        int(final["usage"]["completion_tokens"]),
        int(final["usage"]["prompt_tokens"]),
        finish_reason=final["choices"][0].get("finish_reason"),
        server_ttft_ms=engine.get("ttft_ms"),
        server_decode_tokens_per_s=engine.get("decode_tokens_per_s"),
    )


def bench_server(deployment: str, settings: BenchSettings, work_dir: Path) -> TargetResult:
    """Start the deployment, send the warm-up and the measured requests, stop it."""
    result = TargetResult(deployment)
    with running_server(deployment, settings, work_dir) as (base_url, pids):
        # This process (the client) and, distributed, Redis are part of what is measured.
        ours = [os.getpid(), *pids, *(redis_server_pids() if deployment == "distributed" else [])]
        with httpx.Client(timeout=REQUEST_TIMEOUT_SECS) as client:
            request = lambda: server_stream(client, base_url, settings)  # noqa: E731
            measure_runs(result, settings, request, ours, settings.retries)
    return result


# -- report --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def summary(results: list[TargetResult]) -> list[dict[str, Any]]:
    """One row per target: medians and the ratios to raw."""
    raw = next((r for r in results if r.target == "raw"), None)
    raw_ttft = raw.median("ttft_ms") if raw else None
    raw_rate = raw.median("decode_tokens_per_s") if raw else None
    rows = []
    for result in results:
        ttft, rate = result.median("ttft_ms"), result.median("decode_tokens_per_s")
        rows.append(
            {
                "target": result.target,
                "ttft_ms": ttft,
                "decode_tokens_per_s": rate,
                "ttft_ratio_vs_raw": _ratio(ttft, raw_ttft),
                "tokens_per_s_ratio_vs_raw": _ratio(rate, raw_rate),
                "server_engine_ttft_ms": result.median("server_ttft_ms"),
                "server_engine_decode_tokens_per_s": result.median("server_decode_tokens_per_s"),
                "prompt_tokens": result.runs[0].prompt_tokens if result.runs else None,
                "completion_tokens": sorted({r.completion_tokens for r in result.runs}),
                "runs": len(result.runs),
                "disturbed_runs": result.disturbed_runs(),
                "discarded_runs": len(result.discarded),
                "failed_requests": len(result.failures),
            }
        )
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """The plain-text table."""
    header = [
        "target",
        "TTFT ms (median)",
        "decode tok/s (median)",
        "TTFT ratio vs raw",
        "tok/s ratio vs raw",
        "engine TTFT ms",
        "engine tok/s",
    ]
    body = [
        [
            row["target"],
            _fmt(row["ttft_ms"]),
            _fmt(row["decode_tokens_per_s"]),
            _fmt(row["ttft_ratio_vs_raw"], 2),
            _fmt(row["tokens_per_s_ratio_vs_raw"], 2),
            _fmt(row["server_engine_ttft_ms"]),
            _fmt(row["server_engine_decode_tokens_per_s"]),
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        )

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(cells) for cells in body)])


def tokens_line(rows: list[dict[str, Any]]) -> str:
    """Prompt and completion tokens per target."""
    parts = []
    for row in rows:
        completions = "/".join(str(n) for n in row["completion_tokens"]) or "-"
        parts.append(f"{row['target']} {row['prompt_tokens']} prompt + {completions} completion")
    return "tokens: " + "; ".join(parts)


def conditions_line(rows: list[dict[str, Any]], max_foreign_cpu_pct: float) -> str:
    """Runs disturbed by other processes (kept, and redone), and requests sent again."""
    disturbed = ", ".join(
        f"{row['target']} {row['disturbed_runs']}/{row['runs']} ({row['discarded_runs']} redone)" for row in rows
    )
    failed = ", ".join(f"{row['target']} {row['failed_requests']}" for row in rows)
    return (
        f"runs disturbed by other processes (>{max_foreign_cpu_pct:g}% of the CPU): {disturbed}; "
        f"failed requests (retried): {failed}"
    )


def check_same_output(results: list[TargetResult]) -> list[str]:
    """Warnings when the targets did not all generate the same text (then the comparison is
    not like for like)."""
    warnings = []
    texts = {r.target: {run.text for run in r.runs} for r in results if r.runs}
    for target, variants in texts.items():
        if len(variants) > 1:
            warnings.append(f"{target}: its {len(variants)} runs generated different texts")
    reference = next(iter(texts.get("raw", set())), None)
    for target, variants in texts.items():
        if reference is not None and target != "raw" and reference not in variants:
            warnings.append(f"{target}: the text differs from raw llama-cpp-python's")
    return warnings


def write_json(
    path: Path, settings: BenchSettings, results: list[TargetResult], rows: list[dict[str, Any]], warnings: list[str]
) -> None:
    """Every run and the summary, for later comparison."""
    import llama_cpp

    document = {
        "benchmark": "bench/chat_stream.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            "model_id": MODEL_ID,
            "messages": MESSAGES,
            "temperature": 0.0,
            "context_len": CONTEXT_LEN,
        },
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "llama_cpp_python": llama_cpp.__version__,
        },
        "summary": rows,
        "warnings": warnings,
        "targets": {
            r.target: {
                "warmup": asdict(r.warmup) if r.warmup else None,
                "runs": [asdict(run) for run in r.runs],
                "discarded": [asdict(run) for run in r.discarded],
                "failures": r.failures,
            }
            for r in results
        },
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    log.info("wrote %s", path)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="measured runs per target (default 5)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="engine threads, for raw and as the servers' [hardware] n_threads (default: every core)",
    )
    parser.add_argument("--seed", type=int, default=42, help="sampling seed (default 42)")
    parser.add_argument(
        "--only", action="append", choices=TARGETS, help="run only this target (repeatable; default: all three)"
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="times a failed server request is sent again (default 2)"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        metavar="SECS",
        help=f"before each measured run, wait up to SECS for the CPU to be >= {QUIET_IDLE_PCT:g}%% idle "
        "(default 30; 0: do not wait)",
    )
    parser.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=10.0,
        metavar="PCT",
        help="a run during which other processes took more than PCT%% of the machine's CPU is measured "
        "again (default 10)",
    )
    parser.add_argument(
        "--redo",
        type=int,
        default=None,
        metavar="N",
        help="at most N such runs are measured again per target (default: --runs)",
    )
    parser.add_argument("--json", type=Path, help="also write every run and the summary to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.redo is None:
        args.redo = args.runs
    if min(args.runs, args.threads) < 1 or args.max_tokens < 2 or min(args.retries, args.wait_idle, args.redo) < 0:
        parser.error("--runs and --threads must be >= 1, --max-tokens >= 2, --retries, --wait-idle, --redo >= 0")
    return args


def run_targets(targets: list[str], settings: BenchSettings) -> list[TargetResult]:
    """Each target in turn; a server is always stopped before the next target starts."""
    results: list[TargetResult] = []
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-") as tmp:
        for target in targets:
            if target == "raw":
                results.append(bench_raw(settings))
            else:
                results.append(bench_server(target, settings, Path(tmp)))
    return results


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that the servers this process started are stopped."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    cfg = load_config()
    weights = cfg.weights_file(cfg.models[0])
    if not weights.exists():
        log.error("the model file %s is missing; run ./run.sh setup first", weights)
        return 1
    settings = BenchSettings(
        weights=weights,
        threads=args.threads,
        max_tokens=args.max_tokens,
        seed=args.seed,
        runs=args.runs,
        retries=args.retries,
        wait_idle_secs=args.wait_idle,
        max_foreign_cpu_pct=args.max_foreign_cpu,
        redo=args.redo,
    )
    targets = [t for t in TARGETS if t in (args.only or TARGETS)]
    log.info(
        "targets %s, %d runs, max_tokens %d, %d threads, seed %d",
        targets,
        settings.runs,
        settings.max_tokens,
        settings.threads,
        settings.seed,
    )
    results = run_targets(targets, settings)
    rows = summary(results)
    warnings = check_same_output(results)
    for warning in warnings:
        log.warning("%s", warning)
    print(
        f"SmolLM2-135M-Instruct ({weights.name}): {settings.runs} runs per target after 1 warm-up, "
        f"max_tokens {settings.max_tokens}, temperature 0, seed {settings.seed}, threads {settings.threads}"
    )
    print(render_table(rows))
    print(tokens_line(rows))
    print(conditions_line(rows, settings.max_foreign_cpu_pct))
    if args.json:
        write_json(args.json, settings, results, rows, warnings)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; every server this run started has been stopped")
        sys.exit(130)
