"""Real processes over real sockets: daphne, `manage.py runinference`, Redis, PostgreSQL.

The services are required in CI (`CI` set): a test that cannot reach them fails there. On a
machine without them the tests skip, saying which service is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from hypnos_site.config import BASE_DIR, load_config
from tests import lanes
from tests.e2e.playground import artifacts as artifacts  # the browser tests' screenshot folder (a fixture)

REDIS_URL = os.environ.get("HYPNOS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_ADMIN_URL = os.environ.get("HYPNOS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
START_TIMEOUT_SECS = 120
# server.job_silence_secs of the e2e servers: a job whose heartbeats (every second) stop for this
# long fails its request (the default is 10 s; the Celery worker-death test waits it out).
SILENCE_SECS = 4.0
# The embedded deployment's database, in its data directory (hypnos_site/settings.py).
SQLITE_NAME = "hypnos.sqlite3"


def require_service(name: str, probe) -> None:  # type: ignore[no-untyped-def]
    try:
        probe()
    except Exception as exc:
        message = f"{name} is not reachable ({exc}); see shared docs/services.md to start it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_service("Redis", lambda: redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping())
    return REDIS_URL


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    require_service("PostgreSQL", lambda: psycopg.connect(POSTGRES_ADMIN_URL, connect_timeout=3).close())
    name = "hypnos_e2e_" + uuid.uuid4().hex[:8]
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = POSTGRES_ADMIN_URL.rpartition("/")
    yield f"{base}/{name}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    """A Redis of the test's own on `port` (never the shared one: a test may kill it), keeping
    nothing on disk; returns once it answers."""
    require_service("redis-server (the binary)", lambda: shutil.which("redis-server") or _missing("redis-server"))
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=(directory / "redis.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    pytest.fail(f"redis-server on port {port} did not start")


def _missing(name: str) -> None:
    raise FileNotFoundError(f"{name} is not on PATH")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(directory: Path, ack_timeout_secs: float = 5.0, entity_model: bool = True) -> Path:
    """A config with the suite's real models (absolute paths) and room for long answers; without
    `entity_model`, no Qwen2.5-Coder-0.5B (a test that adds it to the pool itself)."""
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    weights = suite.weights_file(suite.models[0])
    entity_block = (
        f"""[[models]]
id = "qwen2.5-coder-0.5b"
modality = "text_generation"
engine = "ggml_llama"
weights_path = "{suite.weights_file(suite.models[1])}"
context_len = 2048
additional_modalities = ["entity_extraction"]
initial_tier = "tier3_nvme_ssd"

"""
        if entity_model
        else ""
    )
    tool_model = suite.weights_file(suite.models[2])
    media = {m.id: suite.weights_file(m) for m in suite.models if m.modality != "text_generation"}
    path = directory / "hypnos.toml"
    path.write_text(
        f"""
[server]
worker_ack_timeout_secs = {ack_timeout_secs}
job_silence_secs = {SILENCE_SECS}

[hardware]
# Warm copies (tier 2) of at most 512 MiB a server and 3 GiB of (simulated) tier 1: the tool
# model, the chat models and a media model or two fit together. The two shared servers holding
# 4 + 12 GiB each pushed a run past 10 GB.
pinned_ram_budget_bytes = 536870912
simulated_vram_bytes = 3221225472

[limits]
max_tokens_cap = 2000

[[models]]
id = "smollm2-135m"
modality = "text_generation"
engine = "ggml_llama"
weights_path = "{weights}"
context_len = 4096
initial_tier = "tier1_gpu_vram"
aliases = ["gpt-4o-mini"]

{entity_block}[[models]]
id = "qwen2.5-coder-1.5b"
modality = "text_generation"
engine = "ggml_llama"
weights_path = "{tool_model}"
context_len = 4096
tool_router = true
additional_modalities = ["entity_extraction"]
initial_tier = "tier3_nvme_ssd"

[[models]]
id = "all-minilm-l6-v2"
modality = "embeddings"
engine = "ggml_llama"
weights_path = "{media["all-minilm-l6-v2"]}"
context_len = 512
initial_tier = "tier3_nvme_ssd"
aliases = ["text-embedding-3-small"]

[[models]]
id = "whisper-tiny.en"
modality = "speech_to_text"
engine = "ggml_whisper"
weights_path = "{media["whisper-tiny.en"]}"
initial_tier = "tier3_nvme_ssd"
aliases = ["whisper-1"]

[[models]]
id = "piper-joe"
modality = "text_to_speech"
engine = "onnx_runtime"
weights_path = "{media["piper-joe"]}"
initial_tier = "tier3_nvme_ssd"
aliases = ["tts-1"]

[[models]]
id = "docling"
modality = "document_conversion"
engine = "docling"
weights_path = "{media["docling"]}"
initial_tier = "tier3_nvme_ssd"

[[models]]
id = "dcgan-faces"
modality = "image_generation"
engine = "onnx_runtime"
weights_path = "{media["dcgan-faces"]}"
initial_tier = "tier3_nvme_ssd"

[[models]]
id = "realesrgan-x4"
modality = "image_generation"
engine = "ncnn"
weights_path = "{media["realesrgan-x4"]}"
initial_tier = "tier3_nvme_ssd"
"""
    )
    return path


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        stop_all([self], grace)


def stop_all(procs: list[Proc], grace: float = 10) -> None:
    """SIGTERM to every process still running, then SIGKILL to any still there `grace` seconds
    later: all together (stopped one by one, a deployment's teardown cost the sum of theirs)."""
    running = [proc for proc in procs if proc.popen.poll() is None]
    for proc in running:
        proc.popen.terminate()
    deadline = time.monotonic() + grace
    for proc in running:
        try:
            proc.popen.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def start(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    log = log_dir / f"{name}.log"
    popen = subprocess.Popen(
        [sys.executable, *args], cwd=BASE_DIR, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    return Proc(name, popen, log)


def run_manage(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


_MIGRATED: set[str] = set()
_SQLITE_TEMPLATE = tempfile.TemporaryDirectory(prefix="hypnos-migrated-")


def migrate(env: dict[str, str]) -> None:
    """The database of a server about to start on `env`, migrated as `./run.sh` migrates it
    before serving, at the cost of one `manage.py migrate` a run (2 s each): a PostgreSQL
    database (HYPNOS_DATABASE_URL) is migrated the first time a server of this run uses it; an
    embedded server's SQLite file (in HYPNOS_DATA_DIR) is a copy of one migrated once."""
    url = env.get("HYPNOS_DATABASE_URL")
    if url:
        if url not in _MIGRATED:
            run_manage(["migrate", "--no-input", "-v0"], env)
            _MIGRATED.add(url)
        return
    template = Path(_SQLITE_TEMPLATE.name)
    if not (template / SQLITE_NAME).exists():
        run_manage(["migrate", "--no-input", "-v0"], {**env, "HYPNOS_DATA_DIR": str(template)})
    data_dir = Path(env["HYPNOS_DATA_DIR"])
    data_dir.mkdir(parents=True, exist_ok=True)
    # The migrating process closed its connection, so the WAL is checkpointed into the file;
    # its -wal and -shm files are copied too where SQLite kept them.
    for part in template.glob(SQLITE_NAME + "*"):
        shutil.copyfile(part, data_dir / part.name)


def wait_ready(base_url: str, *procs: Proc) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECS
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.popen.poll() is not None:
                pytest.fail(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("server not ready in time:\n" + "\n".join(p.tail() for p in procs))


@dataclass
class Server:
    base_url: str
    env: dict[str, str]
    procs: list[Proc]
    # Distributed: a second web process on the same worker, Redis and database.
    other_base_url: str | None = None


def start_celery(env: dict[str, str], log_dir: Path, name: str = "celery") -> Proc:
    """A real Celery worker for the long jobs, as `./run.sh jobs` starts it; returns once it is
    ready to take jobs."""
    queue = f"{env['HYPNOS_CHANNEL_PREFIX']}.jobs"
    args = ["-m", "celery", "-A", "hypnos_site", "worker", "--pool", "threads", "--concurrency", "2"]
    proc = start(name, [*args, "--queues", queue, "--loglevel", "INFO", "--hostname", f"{name}@%h"], env, log_dir)
    deadline = time.monotonic() + START_TIMEOUT_SECS
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            pytest.fail(f"{name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        if " ready." in proc.log.read_text(errors="replace"):
            return proc
        time.sleep(0.2)
    pytest.fail(f"{name} not ready in time:\n{proc.tail()}")


def base_env(config: Path, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    env.update(HYPNOS_CONFIG=str(config), HYPNOS_DATA_DIR=str(data_dir), DJANGO_SETTINGS_MODULE="hypnos_site.settings")
    env.update(extra)
    return env


@contextmanager
def distributed_cluster(directory: Path, redis_url: str, postgres_url: str) -> Iterator[Server]:
    """daphne + runinference + Redis + PostgreSQL, as `./run.sh` would run them split, with a
    second daphne and a Celery worker; stopped when the block ends."""
    port = free_port()
    env = base_env(
        write_config(directory),
        directory,
        HYPNOS_DEPLOYMENT="distributed",
        HYPNOS_DATABASE_URL=postgres_url,
        HYPNOS_REDIS_URL=redis_url,
        HYPNOS_CHANNEL_PREFIX="hypnos-e2e-" + uuid.uuid4().hex[:8],
        HYPNOS_PORT=str(port),
    )
    migrate(env)
    worker = start("runinference", ["manage.py", "runinference"], env, directory)
    web = start("daphne", ["-m", "hypnos_site.serve"], env, directory)
    other_port = free_port()
    other = start("daphne-2", ["-m", "hypnos_site.serve"], {**env, "HYPNOS_PORT": str(other_port)}, directory)
    procs = [worker, web, other]
    server = Server(f"http://127.0.0.1:{port}", env, procs, f"http://127.0.0.1:{other_port}")
    try:
        wait_ready(server.base_url, worker, web)
        wait_ready(f"http://127.0.0.1:{other_port}", worker, other)
        procs.append(start_celery(env, directory))
        yield server
    finally:
        stop_all(procs)


@contextmanager
def embedded_server(name: str, directory: Path, edit: Callable[[str], str] = lambda text: text) -> Iterator[Server]:
    """`python -m hypnos_site.serve` alone on the suite's config (passed through `edit`): SQLite,
    in-process worker, no services; stopped when the block ends."""
    config = write_config(directory)
    config.write_text(edit(config.read_text()))
    port = free_port()
    env = base_env(config, directory, HYPNOS_PORT=str(port))
    migrate(env)
    web = start(f"daphne-{name}", ["-m", "hypnos_site.serve"], env, directory)
    server = Server(f"http://127.0.0.1:{port}", env, [web])
    try:
        wait_ready(server.base_url, web)
        yield server
    finally:
        web.stop()


class SharedServers:
    """The servers several modules share (`embedded`, `keyed`, `distributed`): each is started by the
    first test that asks for it and stopped right after the last test of the run that does,
    instead of at the session's end, so the models it loaded do not stay in memory through the
    modules that follow (pytest_collection_modifyitems finds that last test)."""

    NAMES = ("embedded", "keyed", "distributed")

    def __init__(self) -> None:
        self.running: dict[str, tuple[Server, ExitStack]] = {}
        self.last_user: dict[str, str] = {}

    def get(self, name: str, start_server: Callable[[], AbstractContextManager[Server]]) -> Server:
        if name not in self.running:
            stack = ExitStack()
            try:
                server = stack.enter_context(start_server())
            except BaseException:
                stack.close()
                raise
            self.running[name] = (server, stack)
        return self.running[name][0]

    def stop(self, name: str) -> None:
        server_and_stack = self.running.pop(name, None)
        if server_and_stack is not None:
            server_and_stack[1].close()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)

    @classmethod
    def uses(cls, item: pytest.Item) -> set[str]:
        """Which shared servers a test needs: by fixture, or through `server`'s parameter."""
        names = {n for n in cls.NAMES if n in getattr(item, "fixturenames", ())}
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("server") in cls.NAMES:
            names.add(callspec.params["server"])
        return names


SHARED = SharedServers()


def _server_group(item: pytest.Item) -> int:
    """0: the test uses the embedded server, 1: the keyed one, 2: no shared server, 3: the
    distributed one."""
    uses = SharedServers.uses(item)
    return 0 if "embedded" in uses else 1 if "keyed" in uses else 3 if "distributed" in uses else 2


@pytest.hookimpl(trylast=True)  # after pytest-django has put the tests in their running order
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The end-to-end tests run in four groups, each in its modules' order: those of the embedded
    # server, of the keyed one, of none, of the distributed deployment. So no two shared servers
    # run at once (a module whose tests take either one, `server`'s parameter, is split
    # across the groups), which keeps the suite's peak memory to one of them.
    e2e = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/e2e/")]
    if e2e:
        ordered = sorted((items[i] for i in e2e), key=_server_group)
        for i, item in zip(e2e, ordered, strict=True):
            items[i] = item
    SHARED.last_user.clear()
    for item in items:
        for name in SharedServers.uses(item):
            SHARED.last_user[name] = item.nodeid
    # The suite's two workers run each shared server's tests whole on one of them (tests/lanes.py).
    names = ("embedded", "keyed", "", "distributed")
    lanes.publish({items[i].nodeid: names[_server_group(items[i])] for i in e2e if _server_group(items[i]) != 2})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        for name, nodeid in SHARED.last_user.items():
            if nodeid == item.nodeid:
                SHARED.stop(name)


def pytest_sessionfinish() -> None:
    SHARED.stop_all()


@pytest.fixture(scope="module")
def distributed(tmp_path_factory, redis_url: str, postgres_url: str) -> Server:
    """The shared distributed deployment (SharedServers)."""
    return SHARED.get(
        "distributed",
        lambda: distributed_cluster(tmp_path_factory.mktemp("distributed"), redis_url, postgres_url),
    )


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Server:
    """The shared embedded server, `python -m hypnos_site.serve` alone: SQLite, in-process
    worker, no services (SharedServers)."""
    return SHARED.get("embedded", lambda: embedded_server("embedded", tmp_path_factory.mktemp("embedded")))


# The keyed server's keys: an admin key and a plain one (label "plain").
KEYED_ADMIN, KEYED_PLAIN = "sk-live-admin", "sk-live-plain"
KEYED_TOML = f'[server]\napi_keys = ["{KEYED_ADMIN}"]\nkeys = [{{ key = "{KEYED_PLAIN}", label = "plain" }}]\n'


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Server:
    """The shared embedded server with API keys (KEYED_ADMIN, KEYED_PLAIN): SQLite, in-process
    worker (SharedServers)."""
    return SHARED.get(
        "keyed",
        lambda: embedded_server(
            "keyed", tmp_path_factory.mktemp("keyed"), lambda text: text.replace("[server]\n", KEYED_TOML, 1)
        ),
    )


@pytest.fixture(params=["embedded", "distributed"])
def server(request) -> Server:  # type: ignore[no-untyped-def]
    return request.getfixturevalue(request.param)
