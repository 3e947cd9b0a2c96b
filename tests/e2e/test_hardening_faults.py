"""Faults between web and worker (issue 12), on a distributed deployment of the module's own:
daphne + a supervised `runinference` (with HYPNOS_FAULT_INJECTION=1) + a Redis the tests kill and
start again, + the session's PostgreSQL.

- the worker killed (SIGKILL) or crashing natively (SIGSEGV in libc, from the engine's thread)
  mid-request: a stream ends with an error chunk then [DONE], a call with 503, once its reply
  deadline has passed and its announcement lapsed; the supervisor starts the worker again and the
  next request is served;
- Redis gone under a request: 503 / an error chunk, never a 500; back by itself when Redis is;
- no worker: 503 within worker_ack_timeout_secs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from channels_redis.core import RedisChannelLayer

from hypnos_site.hard_stop import CUT_EXIT_CODE
from inference.transport.client import ChannelLayerTransport, InferenceClient
from inference.transport.cluster import ANNOUNCE_SECS, ANNOUNCE_TTL_SECS
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Proc, base_env, free_port, migrate, start, start_redis, wait_ready, write_config

pytestmark = pytest.mark.e2e
ACK_TIMEOUT_SECS = 2.0
# The hang test's worker: a short drain and grace (server.shutdown_*_secs), so its cut comes soon.
DRAIN_SECS = 1
GRACE_SECS = 3
CHAT = "/v1/chat/completions"
STORY = {
    "model": "smollm2-135m",
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    "max_tokens": 2000,
}
# From the kill to the error: the web's reply deadline (1.5 s), then until the worker's
# announcement lapses or its restarted process announces itself (inference/transport/client.py): at most
# about ANNOUNCE_TTL_SECS + ANNOUNCE_SECS, 2.0 to 4.0 s measured idle (the SIGSEGV comes
# FAULT_DELAY_SECS after it is armed). 5x that for a busy machine; a stream nothing cut runs on
# to the client's 60 s.
NOTICED_WITHIN_SECS = 5 * (ANNOUNCE_TTL_SECS + ANNOUNCE_SECS + 0.5)


@dataclass
class Deployment:
    base_url: str
    env: dict[str, str]
    redis_port: int
    redis: subprocess.Popen[bytes]
    worker: Proc
    web: Proc
    directory: Path

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def worker_pid(self) -> int:
        """The worker process itself: the supervisor's one child."""
        children = psutil.Process(self.worker.popen.pid).children()
        assert len(children) == 1, children
        return children[0].pid

    def start_redis(self) -> None:
        self.redis = start_redis(self.redis_port, self.directory)

    def fault(self, request_id: str, fault: str = "crash") -> Any:
        """The `fault` control op, sent to the worker through the channel layer like the web's."""

        async def send() -> Any:
            layer = RedisChannelLayer(hosts=[self.redis_url], prefix=self.env["HYPNOS_CHANNEL_PREFIX"])
            return await InferenceClient(ChannelLayerTransport(layer, ACK_TIMEOUT_SECS)).control(
                "fault", {"request_id": request_id, "fault": fault}
            )

        return asyncio.run(send())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, postgres_url: str) -> Iterator[Deployment]:
    directory = tmp_path_factory.mktemp("faults")
    redis_port, port = free_port(), free_port()
    redis_server = start_redis(redis_port, directory)
    env = base_env(
        write_config(directory, ack_timeout_secs=ACK_TIMEOUT_SECS),
        directory,
        HYPNOS_DEPLOYMENT="distributed",
        HYPNOS_DATABASE_URL=postgres_url,
        HYPNOS_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        HYPNOS_CHANNEL_PREFIX="hypnos-faults-" + uuid.uuid4().hex[:8],
        HYPNOS_PORT=str(port),
        HYPNOS_FAULT_INJECTION="1",
    )
    migrate(env)
    worker = start("runinference-supervised", ["manage.py", "runinference"], env, directory)
    web = start("daphne-faults", ["-m", "hypnos_site.serve"], env, directory)
    found = Deployment(f"http://127.0.0.1:{port}", env, redis_port, redis_server, worker, web, directory)
    try:
        wait_ready(found.base_url, worker, web)
        yield found
    finally:
        web.stop()
        worker.stop()
        found.redis.kill()
        found.redis.wait()


def sse_events(response: httpx.Response, on_content: Any = None) -> tuple[list[Any], float]:
    """The stream's data payloads ([DONE] kept as the string) and when the last one came;
    `on_content` runs once, at the first chunk with content."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        event = payload if payload == "[DONE]" else json.loads(payload)
        events.append(event)
        if on_content is not None and event != "[DONE]" and event["choices"][0]["delta"].get("content"):
            on_content()
            on_content = None
    return events, time.monotonic()


def assert_error_chunk_then_done(events: list[Any], error_type: str) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert error["choices"][0]["finish_reason"] == "error"
    assert error["error"]["type"] == error_type
    assert any(e["choices"][0]["delta"].get("content") for e in events[:-2])


def wait_served(base_url: str, timeout: float = 120) -> httpx.Response:
    """Poll a short chat until it is answered (the worker restarted and staged)."""
    deadline = time.monotonic() + timeout
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.post(
                f"{base_url}{CHAT}",
                json={"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 8},
                timeout=30,
            )
            if last.status_code == 200:
                return last
            assert last.status_code == 503, last.text  # restarting: never a 500
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not served again within {timeout} s: {last and last.text}")


def kill_worker_when_streaming(deployment: Deployment, killed: list[float]) -> Any:
    def kill() -> None:
        psutil.Process(deployment.worker_pid()).send_signal(signal.SIGKILL)
        killed.append(time.monotonic())

    return kill


def test_a_stream_ends_with_an_error_chunk_soon_after_the_worker_is_killed(deployment):
    before = deployment.worker_pid()
    killed: list[float] = []
    with httpx.stream("POST", f"{deployment.base_url}{CHAT}", json={**STORY, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events, ended = sse_events(response, kill_worker_when_streaming(deployment, killed))
    assert killed, "no content came before the kill"
    assert_error_chunk_then_done(events, "model_not_available")
    assert ended - killed[0] < NOTICED_WITHIN_SECS
    answer = wait_served(deployment.base_url)
    assert answer.json()["choices"][0]["message"]["content"]
    assert deployment.worker_pid() != before
    assert "died by SIGKILL" in deployment.worker.log.read_text()


def test_a_call_gets_a_503_soon_after_the_worker_is_killed(deployment):
    wait_served(deployment.base_url)
    result: dict[str, Any] = {}

    def call() -> None:
        result["response"] = httpx.post(f"{deployment.base_url}{CHAT}", json=STORY, timeout=60)
        result["at"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    # The call is running when the model holds a lease.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = httpx.get(f"{deployment.base_url}/v1/memory/status", timeout=10).json()
        if any(m["active_leases"] for m in status["models"]):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the call never started")
    psutil.Process(deployment.worker_pid()).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    caller.join(30)
    response = result["response"]
    assert result["at"] - killed < NOTICED_WITHIN_SECS
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.headers["x-request-id"].startswith("req-")
    error = response.json()["error"]
    assert error["type"] == "model_not_available" and error["code"] == "model_not_available"
    assert "stopped answering" in error["message"]
    wait_served(deployment.base_url)


def test_a_native_crash_in_the_engine_is_contained_and_the_worker_restarted(deployment):
    wait_served(deployment.base_url)
    before = deployment.worker_pid()
    armed: list[float] = []
    with httpx.stream("POST", f"{deployment.base_url}{CHAT}", json={**STORY, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]

        def crash() -> None:
            assert deployment.fault(request_id) == {"armed": request_id}
            armed.append(time.monotonic())

        events, ended = sse_events(response, crash)
    assert armed
    assert_error_chunk_then_done(events, "model_not_available")
    assert ended - armed[0] < NOTICED_WITHIN_SECS
    assert psutil.Process(deployment.worker.popen.pid).is_running()  # the supervisor lives on
    log = deployment.worker.log.read_text()
    assert f"request {request_id}: fault injection" in log
    assert f"process {before} died by SIGSEGV" in log
    answer = wait_served(deployment.base_url)
    assert answer.json()["choices"][0]["message"]["content"]
    assert deployment.worker_pid() != before


def test_a_redis_outage_is_a_503_and_the_service_resumes_when_redis_is_back(deployment):
    wait_served(deployment.base_url)
    stopped: list[float] = []

    def stop_redis() -> None:
        deployment.redis.kill()
        deployment.redis.wait()
        stopped.append(time.monotonic())

    with httpx.stream("POST", f"{deployment.base_url}{CHAT}", json={**STORY, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events, ended = sse_events(response, stop_redis)
    assert stopped
    assert_error_chunk_then_done(events, "model_not_available")
    assert ended - stopped[0] < NOTICED_WITHIN_SECS
    try:
        started = time.monotonic()
        refused = httpx.post(
            f"{deployment.base_url}{CHAT}", json={"model": "smollm2-135m", "messages": PARIS_MESSAGES}, timeout=30
        )
        # Redis refuses at once; at worst the ack timeout (2 s here) bounds it: not a hang (30 s).
        assert time.monotonic() - started < 5 * ACK_TIMEOUT_SECS
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "model_not_available"
        assert refused.headers["x-request-id"].startswith("req-")
    finally:
        deployment.start_redis()
    answer = wait_served(deployment.base_url, timeout=60)
    assert answer.json()["choices"][0]["message"]["content"]
    # An abort of the stream that Redis refused was sent again once it was back: the worker
    # stopped the story instead of generating it for nobody, holding the model's slot (on a busy
    # machine, for longer than the requests behind it waited).
    refused_aborts = re.findall(r"request (\S+): the abort did not reach the worker", deployment.web.log.read_text())
    deadline = time.monotonic() + 30
    for request_id in refused_aborts:
        while f"request {request_id}: the abort reached the worker" not in deployment.web.log.read_text():
            assert time.monotonic() < deadline, deployment.web.tail()
            time.sleep(0.2)


def test_without_a_worker_a_chat_is_a_503_within_the_ack_timeout(deployment):
    wait_served(deployment.base_url)
    # SIGTERM: the supervisor stops the worker and exits, once what runs has finished: up to the
    # drain's 30 s (server.shutdown_drain_secs; a relay may still be settling after the Redis
    # restart of the test before).
    deployment.worker.stop(grace=60)
    assert deployment.worker.popen.returncode == 0
    time.sleep(1.2)  # the web's copy of the pool is stale: the request asks the worker's status first
    started = time.monotonic()
    response = httpx.post(
        f"{deployment.base_url}{CHAT}", json={"model": "smollm2-135m", "messages": PARIS_MESSAGES}, timeout=30
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert response.json()["error"]["type"] == "model_not_available"
    assert "runinference" in response.json()["error"]["message"]
    # One ack timeout (the status call's; the request itself then answers at once), not two: the
    # other timeout is the slack for a busy machine.
    assert elapsed < 2 * ACK_TIMEOUT_SECS


def test_sigterm_ends_a_worker_whose_engine_hangs_in_a_native_call(deployment):
    """Runs last: the test before has stopped the deployment's worker. A fresh one, with a 1 s
    drain and a 3 s grace, gets a request whose engine thread then hangs in a native call (libc
    sleep, as a stable-diffusion.cpp generation or a wedged driver would): SIGTERM still ends the
    process, at the drain plus the grace, with the threads it cut in the log."""
    config = Path(deployment.env["HYPNOS_CONFIG"])
    short_drain = config.with_name("hypnos-short-drain.toml")
    short_drain.write_text(
        config.read_text().replace(
            "[server]\n", f"[server]\nshutdown_drain_secs = {DRAIN_SECS}\nshutdown_grace_secs = {GRACE_SECS}\n", 1
        )
    )
    env = {**deployment.env, "HYPNOS_CONFIG": str(short_drain)}
    deployment.worker = start("runinference-hang", ["manage.py", "runinference"], env, deployment.directory)
    try:
        code, waited = hang_then_sigterm(deployment)
    finally:
        # Whatever happened, no process of this test outlives it: the supervisor and its child.
        kill_tree(deployment.worker.popen)
    log = deployment.worker.log
    assert waited >= GRACE_SECS  # a cut, not a clean stop
    assert code == CUT_EXIT_CODE
    text = log.read_text()
    assert "exiting now" in text and "hypnos-infer" in text, deployment.worker.tail()


def hang_then_sigterm(deployment: Deployment) -> tuple[int, float]:
    """A streamed chat whose engine thread then hangs; SIGTERM to the worker's supervisor once
    the hang is logged. The exit status and how long the exit took."""
    wait_served(deployment.base_url, timeout=120)
    hung: list[float] = []
    with httpx.stream("POST", f"{deployment.base_url}{CHAT}", json={**STORY, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]

        def hang() -> None:
            assert deployment.fault(request_id, "hang") == {"armed": request_id}
            hung.append(time.monotonic())

        for line in response.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                hang()
                break
        assert hung, "no content came before the fault"
        log = deployment.worker.log
        deadline = time.monotonic() + 60
        while "hanging in a native call" not in log.read_text():
            assert time.monotonic() < deadline, deployment.worker.tail()
            time.sleep(0.1)
        deployment.worker.popen.send_signal(signal.SIGTERM)  # the supervisor forwards it
        signalled = time.monotonic()
        # The drain and the grace; 5x that for a busy machine. Without the hard stop the process
        # never ends (SIGKILL would be the only way out).
        bound = 5 * (DRAIN_SECS + GRACE_SECS)
        code = deployment.worker.popen.wait(timeout=bound)
    return code, time.monotonic() - signalled


def kill_tree(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and every process below it, those still there."""
    try:
        parent = psutil.Process(popen.pid)
        processes = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        processes = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    popen.wait()
