"""The benchmarks' deployments: one of them started on a config, its base URL, processes and
database yielded, everything stopped after (bench/documents.py, entities.py, images.py)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.chat_stream import (
    READY_TIMEOUT_SECS,
    Proc,
    _clear_redis,
    free_port,
    migrate,
    server_env,
    start_proc,
    wait_ready,
)

log = logging.getLogger("bench.deployments")


@dataclass
class Deployment:
    """A running deployment: where to send requests, its processes, and where its rows are."""

    name: str
    base_url: str
    procs: list[Proc]
    database: str


def start_celery(env: dict[str, str], log_dir: Path) -> Proc:
    """The distributed deployment's job worker, as `./run.sh jobs` starts it, on this run's queue;
    returns once it says it is ready."""
    args = ["-m", "celery", "-A", "hypnos_site", "worker", "--pool", "threads", "--concurrency", "2"]
    args += ["--queues", f"{env['HYPNOS_CHANNEL_PREFIX']}.jobs", "--loglevel", "INFO"]
    args += ["--hostname", f"hypnos-bench-{secrets.token_hex(3)}@%h"]
    proc = start_proc("celery", args, env, log_dir)
    deadline = time.monotonic() + READY_TIMEOUT_SECS
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"celery exited with {proc.popen.returncode}:\n{proc.tail()}")
        if " ready." in proc.log_path.read_text(errors="replace"):
            return proc
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"celery not ready within {READY_TIMEOUT_SECS:g} s:\n{proc.tail()}")


@contextmanager
def database_url(deployment: str, database: str) -> Iterator[str | None]:
    """The distributed deployment's database: chat_stream.py's SQLite file (None: server_env's
    default), or a PostgreSQL database of its own (bench/load.py's), dropped afterwards."""
    if deployment != "distributed" or database == "sqlite":
        yield None
        return
    from bench.load import postgres_database

    with postgres_database() as url:
        yield url


@contextmanager
def running_server(deployment: str, config: Path, work_dir: Path, database: str = "sqlite") -> Iterator[Deployment]:
    """Start one deployment on `config` (distributed: runinference, daphne and a Celery worker);
    yield it; stop its processes (the job worker and the web process first, then the inference
    worker) and clear its Redis keys."""
    data_dir = work_dir / deployment
    data_dir.mkdir()
    port = free_port()
    env = server_env(deployment, config, data_dir, port)
    procs: list[Proc] = []
    with database_url(deployment, database) as url:
        if url:
            env["HYPNOS_DATABASE_URL"] = url
        migrate(env)
        try:
            if deployment == "distributed":
                procs.append(start_proc("runinference", ["manage.py", "runinference"], env, data_dir))
            procs.append(start_proc(f"serve-{deployment}", ["-m", "hypnos_site.serve"], env, data_dir))
            base_url = f"http://127.0.0.1:{port}"
            log.info("%s: ready after %.1f s on %s", deployment, wait_ready(base_url, procs), base_url)
            if deployment == "distributed":
                procs.append(start_celery(env, data_dir))
            yield Deployment(deployment, base_url, procs, url or f"sqlite:///{data_dir / 'hypnos.sqlite3'}")
        except BaseException:
            for proc in procs:
                log.error("%s output (last lines):\n%s", proc.name, proc.tail())
            raise
        finally:
            for proc in reversed(procs):
                proc.stop()
            if deployment == "distributed":
                _clear_redis(env["HYPNOS_CHANNEL_PREFIX"])
