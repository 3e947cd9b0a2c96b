"""Load benchmark: N concurrent mixed clients for S seconds against the embedded and the
distributed deployment, over real sockets (httpx async).

Each client loops over a weighted mix of requests until the time is up: streamed and
non-streamed chat (SmolLM2), embeddings (MiniLM), speech (Piper), transcription (Whisper tiny.en
of the server's own speech), `GET /v1/models` and `GET /v1/memory/status` reads, and a share of
bad requests (malformed JSON, unknown model, wrong type, unknown route) that must be 4xx. It
prints throughput, p50 / p95 per route, status counts, every unexpected 5xx or transport error,
and the peak resident memory of each server process (psutil, sampled every 0.25 s).

- ``embedded``: ``python -m hypnos_site.serve`` alone (SQLite, in-process worker);
- ``distributed``: ``python -m hypnos_site.serve`` + ``manage.py runinference`` over Redis, with a
  PostgreSQL database of its own (created for the run and dropped afterwards).

    .venv/bin/python bench/load.py --clients 200 --secs 60 --deployment both

bench/README.md describes the method and shows figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.chat_stream import (  # noqa: E402
    REDIS_URL,
    Proc,
    _clear_redis,
    _stop_on_sigterm,
    free_port,
    migrate,
    start_proc,
    wait_ready,
)
from hypnos_site.config import load_config  # noqa: E402

log = logging.getLogger("bench.load")

DEPLOYMENTS = ("embedded", "distributed")
POSTGRES_ADMIN_URL = os.environ.get("HYPNOS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
CHAT, EMBED, STT, TTS = "smollm2-135m", "all-minilm-l6-v2", "whisper-tiny.en", "piper-joe"
MESSAGES = [{"role": "user", "content": "Name one colour."}]
SPEECH_TEXT = "Hello world. The weather is nice today."
EMBED_TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "A quick brown fox."]
# Request kinds and their share of the mix (weights, not percentages).
MIX = {
    "chat_stream": 20,
    "chat": 20,
    "embeddings": 15,
    "speech": 8,
    "transcription": 8,
    "models": 8,
    "memory_status": 6,
    "bad_request": 15,
}
REQUEST_TIMEOUT_SECS = 300.0
# After --secs no new request starts; those in flight get this long to finish.
DRAIN_SECS = 60.0
MEMORY_SAMPLE_SECS = 0.25
# A note starting so marks an answer broken whatever its status (a stream that failed midway).
BROKEN = "broken: "


@dataclass
class Sample:
    kind: str
    route: str
    status: int | None  # None: a transport error or a timeout
    ms: float
    ok: bool  # the status this kind must get (2xx; 4xx for a bad request; 429 model_busy is counted apart)
    note: str = ""


@dataclass
class DeploymentResult:
    deployment: str
    clients: int
    secs: float
    wall_secs: float = 0.0
    ready_secs: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0

    def summary(self) -> dict[str, Any]:
        by_route: dict[str, list[Sample]] = defaultdict(list)
        for sample in self.samples:
            by_route[sample.kind].append(sample)
        routes = {}
        for kind, samples in sorted(by_route.items()):
            done = [s.ms for s in samples if s.ok]
            routes[kind] = {
                "route": samples[0].route if len({x.route for x in samples}) == 1 else "(several)",
                "requests": len(samples),
                "per_s": round(len(samples) / self.wall_secs, 2) if self.wall_secs else None,
                "p50_ms": _pct(done, 50),
                "p95_ms": _pct(done, 95),
                "statuses": dict(sorted(Counter(str(s.status) for s in samples).items())),
                "unexpected": sum(1 for s in samples if not s.ok and s.status != 429),
            }
        unexpected = [s for s in self.samples if not s.ok and s.status != 429]
        return {
            "deployment": self.deployment,
            "clients": self.clients,
            "secs": self.secs,
            "wall_secs": round(self.wall_secs, 1),
            "ready_secs": round(self.ready_secs, 1),
            "requests": len(self.samples),
            "per_s": round(len(self.samples) / self.wall_secs, 1) if self.wall_secs else None,
            "statuses": dict(sorted(Counter(str(s.status) for s in self.samples).items())),
            "unexpected_5xx": sum(1 for s in self.samples if s.status is not None and s.status >= 500),
            "transport_errors": sum(1 for s in self.samples if s.status is None),
            "unexpected": len(unexpected),
            "unfinished": self.unfinished,
            "peak_rss_mib": {name: round(b / 2**20, 1) for name, b in self.peak_rss_bytes.items()},
            "routes": routes,
            "unexpected_examples": [f"{s.kind} {s.status}: {s.note}" for s in unexpected[:10]],
        }


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


# -- servers -------------------------------------------------------------------------------------


def write_config(directory: Path, threads: int | None, max_queue: int) -> Path:
    """The suite's chat, embedding, speech and transcription models (absolute paths), SmolLM2
    staged at start, the others loaded by the warm-up."""
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    blocks = []
    for model in suite.models:
        if model.id not in (CHAT, EMBED, STT, TTS):
            continue
        weights = suite.weights_file(model)
        if not weights.exists():
            raise SystemExit(f"{weights} is missing; run ./run.sh setup first")
        tier = "tier1_gpu_vram" if model.id == CHAT else "tier3_nvme_ssd"
        blocks.append(
            f'[[models]]\nid = "{model.id}"\nmodality = "{model.modality}"\nengine = "{model.engine}"\n'
            f"weights_path = {json.dumps(str(weights))}\ncontext_len = {model.context_len}\n"
            f'initial_tier = "{tier}"\n'
        )
    hardware = f"[hardware]\nn_threads = {threads}\n\n" if threads else ""
    path = directory / "hypnos.toml"
    path.write_text(f"{hardware}[limits]\nmax_queue_per_model = {max_queue}\n\n" + "\n".join(blocks))
    return path


@contextmanager
def postgres_database() -> Iterator[str]:
    """A database of its own on the PostgreSQL of services.md, dropped afterwards."""
    import psycopg

    name = "hypnos_bench_" + secrets.token_hex(4)
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield POSTGRES_ADMIN_URL.rpartition("/")[0] + "/" + name
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def running_server(
    deployment: str, work_dir: Path, threads: int | None, max_queue: int
) -> Iterator[tuple[str, list[Proc], float]]:
    """Start one deployment; yield its base URL, its processes and the seconds to ready."""
    data_dir = work_dir / deployment
    data_dir.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    env.update(
        HYPNOS_CONFIG=str(write_config(data_dir, threads, max_queue)),
        HYPNOS_DATA_DIR=str(data_dir),
        HYPNOS_PORT=str(port),
        HYPNOS_HOST="127.0.0.1",
        HYPNOS_DEPLOYMENT=deployment,
        DJANGO_SETTINGS_MODULE="hypnos_site.settings",
    )
    with _database(deployment) as database_url:
        if database_url:
            env.update(
                HYPNOS_DATABASE_URL=database_url,
                HYPNOS_REDIS_URL=REDIS_URL,
                HYPNOS_CHANNEL_PREFIX="hypnos-bench-" + secrets.token_hex(4),
            )
        migrate(env)
        procs: list[Proc] = []
        try:
            if deployment == "distributed":
                procs.append(start_proc("runinference", ["manage.py", "runinference"], env, data_dir))
            procs.append(start_proc(f"daphne-{deployment}", ["-m", "hypnos_site.serve"], env, data_dir))
            base_url = f"http://127.0.0.1:{port}"
            secs = wait_ready(base_url, procs)
            log.info("%s: ready after %.1f s on %s", deployment, secs, base_url)
            yield base_url, procs, secs
        except BaseException:
            for proc in procs:
                log.error("%s output (last lines):\n%s", proc.name, proc.tail())
            raise
        finally:
            for proc in reversed(procs):
                proc.stop()
            if deployment == "distributed":
                _clear_redis(env["HYPNOS_CHANNEL_PREFIX"])


@contextmanager
def _database(deployment: str) -> Iterator[str | None]:
    """The distributed deployment's own PostgreSQL database; none for the embedded one (SQLite)."""
    if deployment != "distributed":
        yield None
        return
    with postgres_database() as url:
        yield url


class MemorySampler:
    """Peak resident memory of each server process (with its children), sampled in a thread."""

    def __init__(self, procs: list[Proc]):
        self.procs = {proc.name: psutil.Process(proc.popen.pid) for proc in procs}
        self.peak: dict[str, int] = dict.fromkeys(self.procs, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _rss(self, process: psutil.Process) -> int:
        try:
            total = process.memory_info().rss
            for child in process.children(recursive=True):
                total += child.memory_info().rss
            return total
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, process in self.procs.items():
                self.peak[name] = max(self.peak[name], self._rss(process))
            self._stop.wait(MEMORY_SAMPLE_SECS)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- clients --------------------------------------------------------------------------------------


class Requests:
    """The request kinds of the mix, each one awaited to its last byte."""

    def __init__(self, client: httpx.AsyncClient, max_tokens: int, clip: bytes):
        self.client, self.max_tokens, self.clip = client, max_tokens, clip

    async def chat_stream(self, rng: random.Random) -> tuple[str, int, str]:
        body = {
            "model": CHAT,
            "messages": MESSAGES,
            "max_tokens": self.max_tokens,
            "stream": True,
            "seed": rng.randrange(1 << 30),
        }
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return "/v1/chat/completions", response.status_code, _note(response)
            done, error = False, ""
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"finish_reason": "error"' in line:
                    error = "an error chunk: " + line[6:200]
            if error or not done:
                return "/v1/chat/completions", 200, BROKEN + (error or "the stream ended without [DONE]")
            return "/v1/chat/completions", 200, ""

    async def chat(self, rng: random.Random) -> tuple[str, int, str]:
        body = {"model": CHAT, "messages": MESSAGES, "max_tokens": self.max_tokens, "seed": rng.randrange(1 << 30)}
        return await self._post("/v1/chat/completions", json=body)

    async def embeddings(self, rng: random.Random) -> tuple[str, int, str]:
        texts = rng.sample(EMBED_TEXTS, rng.randint(1, len(EMBED_TEXTS)))
        return await self._post("/v1/embeddings", json={"model": EMBED, "input": texts})

    async def speech(self, rng: random.Random) -> tuple[str, int, str]:
        return await self._post(
            "/v1/audio/speech",
            json={"model": TTS, "input": SPEECH_TEXT, "response_format": rng.choice(["wav", "mp3", "pcm"])},
        )

    async def transcription(self, rng: random.Random) -> tuple[str, int, str]:
        return await self._post(
            "/v1/audio/transcriptions", data={"model": STT}, files={"file": ("speech.wav", self.clip, "audio/wav")}
        )

    async def models(self, rng: random.Random) -> tuple[str, int, str]:
        response = await self.client.get("/v1/models")
        return "/v1/models", response.status_code, _note(response)

    async def memory_status(self, rng: random.Random) -> tuple[str, int, str]:
        response = await self.client.get("/v1/memory/status")
        return "/v1/memory/status", response.status_code, _note(response)

    async def bad_request(self, rng: random.Random) -> tuple[str, int, str]:
        kind = rng.choice(["malformed", "unknown_model", "wrong_type", "unknown_route", "empty_input"])
        if kind == "malformed":
            return await self._post(
                "/v1/chat/completions",
                content=b'{"model": "smollm2-135m", "messages": [',
                headers={"content-type": "application/json"},
            )
        if kind == "unknown_model":
            return await self._post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        if kind == "wrong_type":
            return await self._post("/v1/embeddings", json={"model": EMBED, "input": 42})
        if kind == "empty_input":
            return await self._post("/v1/audio/speech", json={"model": TTS, "input": ""})
        response = await self.client.get("/v1/no/such/route")
        return "/v1/no/such/route", response.status_code, _note(response)

    async def _post(self, path: str, **kwargs: Any) -> tuple[str, int, str]:
        response = await self.client.post(path, **kwargs)
        return path, response.status_code, _note(response)


def _note(response: httpx.Response) -> str:
    return "" if response.status_code < 400 else response.text[:200]


def _ok(kind: str, status: int) -> bool:
    if kind == "bad_request":
        return 400 <= status < 500 and status != 429
    return 200 <= status < 300


async def client_loop(requests: Requests, rng: random.Random, until: float, samples: list[Sample]) -> None:
    kinds, weights = list(MIX), list(MIX.values())
    while time.monotonic() < until:
        kind = rng.choices(kinds, weights)[0]
        started = time.perf_counter()
        try:
            route, status, note = await getattr(requests, kind)(rng)
            sample = Sample(kind, route, status, 0.0, _ok(kind, status) and not note.startswith(BROKEN), note)
        except httpx.HTTPError as exc:
            sample = Sample(kind, kind, None, 0.0, False, f"{type(exc).__name__}: {exc}"[:200])
        sample.ms = (time.perf_counter() - started) * 1000
        samples.append(sample)


async def warm_up(client: httpx.AsyncClient, max_tokens: int) -> bytes:
    """One request of each model, so that loads are not measured; the speech answer becomes the
    transcription clip."""
    checks = [
        await client.post("/v1/chat/completions", json={"model": CHAT, "messages": MESSAGES, "max_tokens": max_tokens}),
        await client.post("/v1/embeddings", json={"model": EMBED, "input": EMBED_TEXTS}),
    ]
    speech = await client.post("/v1/audio/speech", json={"model": TTS, "input": SPEECH_TEXT})
    checks += [
        speech,
        await client.post(
            "/v1/audio/transcriptions", data={"model": STT}, files={"file": ("speech.wav", speech.content, "audio/wav")}
        ),
    ]
    for response in checks:
        if response.status_code != 200:
            raise RuntimeError(f"warm-up {response.request.url.path}: {response.status_code} {response.text[:300]}")
    return speech.content


async def drive(base_url: str, clients: int, secs: float, max_tokens: int, seed: int, result: DeploymentResult) -> None:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_SECS, connect=30.0, pool=REQUEST_TIMEOUT_SECS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        clip = await warm_up(client, max_tokens)
        requests = Requests(client, max_tokens, clip)
        started = time.monotonic()
        until = started + secs
        tasks = [
            asyncio.create_task(client_loop(requests, random.Random(seed + n), until, result.samples))
            for n in range(clients)
        ]
        done, pending = await asyncio.wait(tasks, timeout=secs + DRAIN_SECS)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        result.unfinished = len(pending)
        result.wall_secs = time.monotonic() - started


def bench_deployment(deployment: str, args: argparse.Namespace, work_dir: Path) -> DeploymentResult:
    result = DeploymentResult(deployment, args.clients, args.secs)
    with running_server(deployment, work_dir, args.threads, args.max_queue) as (base_url, procs, ready_secs):
        result.ready_secs = ready_secs
        with MemorySampler(procs) as memory:
            asyncio.run(drive(base_url, args.clients, args.secs, args.max_tokens, args.seed, result))
        result.peak_rss_bytes = memory.peak
    return result


# -- output ------------------------------------------------------------------------------------------


def print_table(results: list[DeploymentResult]) -> None:
    for result in results:
        s = result.summary()
        print(
            f"\n{s['deployment']}: {s['clients']} clients for {s['secs']:g} s (drained in {s['wall_secs']} s), "
            f"{s['requests']} requests, {s['per_s']} req/s; statuses {s['statuses']}; unexpected 5xx "
            f"{s['unexpected_5xx']}, transport errors {s['transport_errors']}, other unexpected answers "
            f"{s['unexpected'] - s['unexpected_5xx'] - s['transport_errors']}, unfinished clients {s['unfinished']}"
        )
        print(f"peak RSS (MiB): {s['peak_rss_mib']}")
        header = (
            f"{'kind':<14}| {'route':<26}| {'requests':>8} | {'req/s':>6} | {'p50 ms':>8} | {'p95 ms':>8} | statuses"
        )
        print(header)
        print("-" * len(header))
        for kind, r in s["routes"].items():
            print(
                f"{kind:<14}| {r['route']:<26}| {r['requests']:>8} | {r['per_s']:>6} | {_fmt(r['p50_ms']):>8} | "
                f"{_fmt(r['p95_ms']):>8} | {r['statuses']}"
            )
        for example in s["unexpected_examples"]:
            print(f"  unexpected: {example}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients (default 200)")
    parser.add_argument("--secs", type=float, default=60.0, help="seconds new requests are started (default 60)")
    parser.add_argument("--deployment", choices=[*DEPLOYMENTS, "both"], default="both")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of the chat requests (default 16)")
    parser.add_argument(
        "--max-queue",
        type=int,
        default=8,
        help="the servers' limits.max_queue_per_model (default 8, the server's own default)",
    )
    parser.add_argument("--threads", type=int, default=None, help="the servers' [hardware] n_threads (default: unset)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices (default 1)")
    parser.add_argument("--json", type=Path, help="also write the settings and the summaries to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.secs <= 0 or args.max_tokens < 1 or args.max_queue < 1:
        parser.error("--clients, --max-tokens and --max-queue must be >= 1, --secs > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    deployments = list(DEPLOYMENTS) if args.deployment == "both" else [args.deployment]
    results = []
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-load-") as tmp:
        for deployment in deployments:
            results.append(bench_deployment(deployment, args, Path(tmp)))
    print_table(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "bench/load.py",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"mix": MIX},
                    "machine": {
                        "python": platform.python_version(),
                        "platform": platform.platform(),
                        "cpu_count": os.cpu_count(),
                        "load_average": os.getloadavg(),
                    },
                    "summary": [r.summary() for r in results],
                },
                indent=2,
            )
        )
    unexpected = sum(r.summary()["unexpected"] for r in results)
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
