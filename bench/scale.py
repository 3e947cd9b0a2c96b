"""Two models on two inference workers against the same two models on one worker that must
swap them (issue 18), side by side in one run.

Both set-ups are the distributed deployment: one daphne (`python -m hypnos_site.serve`), Redis,
SQLite, and either two `manage.py runinference` (`gpu-a`, `gpu-b`) or one. Every worker holds at
most one model in tier 1 (`hardware.max_resident_models = 1`, the stand-in for a device that
fits one of them) and runs its engines on `--threads` threads: two workers are two devices, one
worker is one device shared by both models. Load: `--clients` clients per model, each sending
`--requests` streamed chats of `--max-tokens` tokens one after another, all at once. Printed:
aggregate completion tokens/s (all tokens / wall time), per-request latency p50 / p95, tier-1
loads and evictions seen in the memory status, and the ratios two / one.

    .venv/bin/python bench/scale.py [--requests 8] [--clients 1] [--max-tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from chat_stream import Proc, _clear_redis, free_port, migrate, server_env  # noqa: E402
from server_cost import redis_for_benchmark, start_process, wait_ready  # noqa: E402

from hypnos_site.config import BASE_DIR, load_config  # noqa: E402

log = logging.getLogger("bench.scale")
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
PROMPT = [{"role": "user", "content": "Tell me about the history of Paris in a few sentences."}]


def write_config(directory: Path, name: str, threads: int) -> Path:
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    blocks = []
    for model in suite.models:
        if model.id in MODELS:
            blocks.append(
                f"""
[[models]]
id = "{model.id}"
modality = "text_generation"
engine = "ggml_llama"
weights_path = {json.dumps(str(suite.weights_file(model)))}
context_len = 1024
"""
            )
    path = directory / f"{name}.toml"
    path.write_text(f"[hardware]\nn_threads = {threads}\nmax_resident_models = 1\n" + "".join(blocks))
    return path


@dataclass
class Run:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    failures: int = 0
    retries: int = 0
    loads: int = 0
    evictions: int = 0
    served_by: dict[str, set[str]] = field(default_factory=dict)

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@contextmanager
def deployment(
    workers: list[str], threads: int, redis_url: str, work_dir: Path
) -> Iterator[tuple[str, dict[str, str]]]:
    directory = work_dir / f"{len(workers)}-workers"
    directory.mkdir()
    port = free_port()
    env = server_env("distributed", write_config(directory, "web", threads), directory, port)
    env["HYPNOS_REDIS_URL"] = redis_url
    migrate(env)
    procs: list[Proc] = []
    try:
        for name in workers:
            worker_env = {**env, "HYPNOS_CONFIG": str(write_config(directory, name, threads)), "HYPNOS_WORKER_ID": name}
            procs.append(start_process(name, [sys.executable, "manage.py", "runinference"], worker_env, directory))
        procs.append(start_process("web", [sys.executable, "-m", "hypnos_site.serve"], env, directory))
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url + "/ready", procs)
        deadline = time.monotonic() + 60
        while len(httpx.get(base_url + "/v1/memory/status", timeout=30).json()["workers"]) < len(workers):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not announce themselves")
            time.sleep(0.3)
        yield base_url, env
    finally:
        for proc in reversed(procs):
            proc.stop()
        _clear_redis(env["HYPNOS_CHANNEL_PREFIX"])


RETRY_SECS = 0.25


def stream(client: httpx.Client, base_url: str, model: str, max_tokens: int) -> tuple[float, int, str, int]:
    """One streamed chat as a client following spec §18's retry advice sees it: a 507 (the other
    model holds tier 1 under a lease) is retried after RETRY_SECS, and the latency counts from the
    first try. Returns (ms, completion tokens, worker, retries)."""
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    tokens, worker, retries = 0, "", 0
    while True:
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code == 507 and retries < 200:
                retries += 1
                time.sleep(RETRY_SECS)
                continue
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                worker = chunk.get("hypnos_telemetry", {}).get("worker", worker)
        return (time.perf_counter() - started) * 1000, tokens, worker, retries


def load(base_url: str, run: Run, args: argparse.Namespace) -> None:
    lock = threading.Lock()

    def client_loop(model: str) -> None:
        with httpx.Client(timeout=300) as client:
            for _ in range(args.requests):
                try:
                    ms, tokens, worker, retries = stream(client, base_url, model, args.max_tokens)
                except httpx.HTTPError as exc:
                    log.warning("%s: %s", model, exc)
                    with lock:
                        run.failures += 1
                    continue
                with lock:
                    run.latencies_ms.append(ms)
                    run.tokens += tokens
                    run.retries += retries
                    run.served_by.setdefault(model, set()).add(worker)

    # One warm-up each, so both set-ups start with the models read once (tier 2 or 3 alike).
    with httpx.Client(timeout=300) as client:
        for model in MODELS:
            stream(client, base_url, model, 2)
    before = httpx.get(base_url + "/v1/memory/status", timeout=30).json()
    threads = [threading.Thread(target=client_loop, args=(m,)) for m in MODELS for _ in range(args.clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - started
    after = httpx.get(base_url + "/v1/memory/status", timeout=30).json()
    run.loads = _loads(after) - _loads(before)
    run.evictions = after["evictions_total"] - before["evictions_total"]


def _loads(status: dict[str, Any]) -> int:
    """Tier-1 loads on every worker (a model's placements: one per worker)."""
    return sum(int(p.get("loads", 0)) for m in status["models"] for p in m["placements"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="streamed chats per client")
    parser.add_argument("--clients", type=int, default=1, help="clients per model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per worker")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    runs = []
    with tempfile.TemporaryDirectory(prefix="hypnos-scale-") as tmp, redis_for_benchmark(Path(tmp)) as redis_url:
        for name, workers in [("two workers", ["gpu-a", "gpu-b"]), ("one worker", ["gpu-a"])]:
            run = Run(name)
            with deployment(workers, args.threads, redis_url, Path(tmp)) as (base_url, _env):
                load(base_url, run, args)
            runs.append(run)
            log.info("%s: %.1f tok/s, p95 %.0f ms, served by %s", name, run.tokens_per_s, run.p(0.95), run.served_by)
    two, one = runs
    print(
        f"\n{len(MODELS)} models x {args.clients} client(s) x {args.requests} streamed chats of {args.max_tokens} "
        f"tokens, {args.threads} engine thread(s) per worker, max_resident_models = 1 per worker\n"
    )
    header = (
        f"{'set-up':<12} | {'aggr tok/s':>10} | {'p50 ms':>8} | {'p95 ms':>8} | {'loads':>5} | {'evictions':>9} "
        "| 507 retries | failed | served by"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        served = "; ".join(f"{m}: {','.join(sorted(w))}" for m, w in sorted(run.served_by.items()))
        print(
            f"{run.name:<12} | {run.tokens_per_s:>10.1f} | {run.p(0.5):>8.0f} | {run.p(0.95):>8.0f} | {run.loads:>5} | "
            f"{run.evictions:>9} | {run.retries:>11} | {run.failures:>6} | {served}"
        )
    tok_ratio = two.tokens_per_s / one.tokens_per_s if one.tokens_per_s else float("nan")
    p95_ratio = one.p(0.95) / two.p(0.95) if two.p(0.95) else float("nan")
    print(f"\ntwo / one: aggregate tokens/s {tok_ratio:.2f}x; p95 latency one / two {p95_ratio:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": vars(args) | {"json": str(args.json)},
                    "runs": [
                        {
                            "name": r.name,
                            "tokens_per_s": r.tokens_per_s,
                            "p50_ms": r.p(0.5),
                            "p95_ms": r.p(0.95),
                            "loads": r.loads,
                            "evictions": r.evictions,
                            "failures": r.failures,
                            "retries_507": r.retries,
                            "latencies_ms": r.latencies_ms,
                            "served_by": {m: sorted(w) for m, w in r.served_by.items()},
                        }
                        for r in runs
                    ],
                    "tokens_per_s_ratio": tok_ratio,
                    "p95_ratio": p95_ratio,
                },
                indent=2,
            )
        )
    return 0 if not two.failures and not one.failures else 1


if __name__ == "__main__":
    sys.exit(main())
