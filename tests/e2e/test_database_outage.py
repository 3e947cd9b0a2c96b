"""PostgreSQL down under a running server (issue 18 item 3): GET /ready answers 503 with the
reason, a request that needs the database is a 503 in the error envelope (never a 500), nothing
crashes, and the service resumes by itself when the database is back.

The embedded deployment on a PostgreSQL cluster of the test's own (initdb + pg_ctl on a free port,
its socket in its own directory; never the shared one on 5432), stopped with `pg_ctl stop -m
immediate` (as a crash or a lost host would) and started again.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Proc, base_env, free_port, require_service, run_manage, start, wait_ready, write_config

pytestmark = pytest.mark.e2e
ADMIN = "sk-e2e-db-admin"
# A key the config does not hold: only the database can tell whether it is one.
UNKNOWN_KEY = "hyp_not_a_key_of_this_server"
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 16, "temperature": 0}
# From the database's stop to /ready's 503: one probe (a refused connection fails at once).
DOWN_NOTICED_WITHIN_SECS = 5.0
BACK_WITHIN_SECS = 15.0
# models_registry.authentication.DB_KEYS_TTL_SECS (2 s), and some.
KEYS_CACHE_SECS = 3.0


def _postgres_bin(name: str) -> str:
    for candidate in [
        shutil.which(name),
        f"/usr/local/bin/{name}",
        *sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")),
    ]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"{name} (PostgreSQL's server binaries) is not installed")


@dataclass
class Cluster:
    """A PostgreSQL cluster of the test's own, run as the `postgres` user when we are root
    (the server refuses to run as root)."""

    directory: Path
    port: int
    pg_ctl: str
    as_postgres: list[str]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        command = [*self.as_postgres, self.pg_ctl, "-D", str(self.directory / "data"), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("start", "-w", "-t", "60", "-l", str(self.directory / "postgres.log"), "-o", options)
        psycopg.connect(self.url, connect_timeout=3).close()

    def stop(self) -> None:
        self._ctl("stop", "-m", "immediate", "-w")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    binaries: dict[str, str] = {}

    def probe() -> None:
        binaries.update(initdb=_postgres_bin("initdb"), pg_ctl=_postgres_bin("pg_ctl"))

    require_service("PostgreSQL's initdb and pg_ctl", probe)
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    directory = Path(tempfile.mkdtemp(prefix="hypnos-pg-", dir="/tmp"))
    if as_postgres:
        shutil.chown(directory, "postgres", "postgres")
    found = Cluster(directory, free_port(), binaries["pg_ctl"], as_postgres)
    try:
        init = [*as_postgres, binaries["initdb"], "-D", str(directory / "data"), "-A", "trust", "-U", "postgres"]
        done = subprocess.run([*init, "--no-sync"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        found.start()
        yield found
    finally:
        if (directory / "data" / "postmaster.pid").exists():
            subprocess.run(
                [*as_postgres, found.pg_ctl, "-D", str(directory / "data"), "stop", "-m", "immediate", "-w"],
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def web(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, Proc]]:
    """The embedded server (in-process worker) on the cluster, an admin key in the config."""
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace("[server]\n", f'[server]\napi_keys = ["{ADMIN}"]\n', 1))
    port = free_port()
    env = base_env(config, tmp_path, HYPNOS_PORT=str(port), HYPNOS_DATABASE_URL=cluster.url)
    run_manage(["migrate", "--no-input", "-v0"], env)
    proc = start("daphne-db-outage", ["-m", "hypnos_site.serve"], env, tmp_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, proc)
        yield base_url, proc
    finally:
        proc.stop()


def _ready(base_url: str) -> httpx.Response:
    return httpx.get(f"{base_url}/ready", timeout=15)


def _until(check, within: float) -> float:  # type: ignore[no-untyped-def]
    """Poll `check` (a request; True when done) until it holds; the seconds it took."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > within:
            pytest.fail(f"not within {within} s")
        time.sleep(0.1)


# Requests at once: the server's request threads are pooled, each with its own kept connection,
# and only concurrent requests reach more than the most recently used one.
AT_ONCE = 12


def _unknown_key_at_once(base_url: str) -> list[int]:
    """AT_ONCE chat calls with a key only the database could know, at once: their statuses."""

    def one(_: int) -> int:
        headers = {"Authorization": f"Bearer {UNKNOWN_KEY}"}
        return httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, headers=headers, timeout=60).status_code

    with ThreadPoolExecutor(AT_ONCE) as pool:
        return list(pool.map(one, range(AT_ONCE)))


def _database_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "database_unavailable" and error["type"] == "model_not_available", error
    assert "database" in error["message"]
    assert int(response.headers["retry-after"]) >= 1


def test_the_database_going_away_is_a_503_and_its_return_is_noticed_by_itself(
    cluster: Cluster, web: tuple[str, Proc]
) -> None:
    base_url, proc = web
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        assert _ready(base_url).json() == {"ready": True}
        before = client.post("/v1/chat/completions", json=CHAT, headers=admin)
        assert before.status_code == 200, before.text
        assert client.get("/v1/logs", headers=admin).status_code == 200
        # Several request threads now hold a connection to the database that is about to go.
        assert _unknown_key_at_once(base_url) == [401] * AT_ONCE

        cluster.stop()
        stopped = time.monotonic()
        seen: list[httpx.Response] = []

        def not_ready() -> bool:
            probe_started = time.monotonic()
            seen.append(_ready(base_url))
            assert time.monotonic() - probe_started < 10, "GET /ready hung on the dead database"
            return seen[-1].status_code == 503

        down_secs = _until(not_ready, DOWN_NOTICED_WITHIN_SECS)
        body = seen[-1].json()
        assert body["ready"] is False and body["reason"].startswith("the database is not answering: "), body

        # The request log (a DRF view): the envelope, not a 500.
        _database_unavailable(client.get("/v1/logs", headers=admin))
        # A key only the database could know (the accounting middleware's lookup, before any
        # view), in the OpenAI envelope on /v1 and in Ollama's shape on /api.
        _database_unavailable(
            client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {UNKNOWN_KEY}"})
        )
        ollama = client.post(
            "/api/chat",
            json={"model": "smollm2-135m", "messages": PARIS_MESSAGES, "stream": False},
            headers={"Authorization": f"Bearer {UNKNOWN_KEY}"},
        )
        assert ollama.status_code == 503 and "database" in ollama.json()["error"], ollama.text
        # Past the few seconds the server trusts its last look at the database's keys: the
        # config's key still needs no database, the chat is served and its log entry is lost,
        # not waited for.
        time.sleep(max(0.0, stopped + KEYS_CACHE_SECS - time.monotonic()))
        during = client.post("/v1/chat/completions", json=CHAT, headers=admin)
        assert during.status_code == 200, during.text
        assert proc.popen.poll() is None, proc.tail()
        still = _ready(base_url)
        assert still.status_code == 503 and "database" in still.json()["reason"], still.text
        outage_secs = time.monotonic() - stopped

        cluster.start()
        back_secs = _until(lambda: _ready(base_url).status_code == 200, BACK_WITHIN_SECS)
        after = client.post("/v1/chat/completions", json=CHAT, headers=admin)
        assert after.status_code == 200, after.text
        # The request log is written again (the writer's connection reconnected).
        logs = client.get("/v1/logs", headers=admin)
        assert logs.status_code == 200, logs.text
        ids = {record["id"] for record in logs.json()["records"]}
        assert before.headers["x-request-id"] in ids and after.headers["x-request-id"] in ids, ids
        unknown = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {UNKNOWN_KEY}"})
        assert unknown.status_code == 401, unknown.text
        # Every request thread, the ones idle through the outage too, checks its kept connection
        # before using it: none answers "server closed the connection unexpectedly" (a 503).
        for _ in range(3):
            assert _unknown_key_at_once(base_url) == [401] * AT_ONCE

    assert proc.popen.poll() is None, proc.tail()
    log = proc.log.read_text(errors="replace")
    assert "status=500" not in log and "Internal Server Error" not in log and "unhandled error" not in log, log[-4000:]
    print(
        f"/ready 503 {down_secs:.2f} s after the stop, 200 {back_secs:.2f} s after the start; outage {outage_secs:.1f}s"
    )
