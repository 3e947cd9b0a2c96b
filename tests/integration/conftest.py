from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from django.test import AsyncClient

from hypnos_site.config import HypnosConfig
from hypnos_site.errors import HypnosError
from inference.transport.runtime import runtime, trim_heap
from inference.worker import Worker
from logs.store import settled
from memory.tiers import MemoryTier

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker() -> Worker:
    """The embedded worker with the real SmolLM2 model, staged at its first use; the same one for
    every test until tests/conftest.py lets it go before an end-to-end module (then the next test
    that asks for it starts a new one)."""
    worker = runtime.embedded_worker()
    assert worker.wait_ready(120), "startup staging did not finish"
    assert worker.models["smollm2-135m"].problem is None
    return worker


@pytest.fixture(scope="module", autouse=True)
def engines_released_after_the_module() -> Iterator[None]:
    """Nothing a module loaded stays loaded for the next one (issue 31): after each module the
    session's in-process worker puts every model back on disk but those its config stages in
    tier 1 (SmolLM2), so the suite's memory is one module's, not the sum of every model any
    module touched (the 1.5B entity model alone held ~1.8 GB through the rest of the run)."""
    yield
    worker = runtime.in_process_worker()
    if worker is None:
        return
    for model_id, model in list(worker.models.items()):
        if model.engine is None or model.config.initial_tier == MemoryTier.TIER1:
            continue
        if worker.tiers.placement(model_id).primary_tier == MemoryTier.TIER3:
            continue
        try:
            worker.move(model_id, MemoryTier.TIER3, None)
        except HypnosError:  # still busy with a request the module left behind: kept
            pass
    trim_heap()


@pytest.fixture
async def api(worker: Worker, db: None) -> AsyncIterator[AsyncClient]:
    yield AsyncClient()
    # The request log is written after each response, and an eager job's thread (embedded
    # Celery) ends after its answer: both land before this test's database is emptied, never
    # in the next test's.
    await settled()
    await jobs_settled()


async def jobs_settled(timeout: float = 60.0) -> None:
    """Wait for the embedded deployment's job threads (inference.jobs.feed.dispatch) to end."""
    for thread in threading.enumerate():
        if thread.name.startswith(("hypnos-job-", "hypnos-img-", "hypnos-batch_")):
            await asyncio.to_thread(thread.join, timeout)


@pytest.fixture
def use_worker() -> Iterator[Any]:
    """Route the views to another Worker for the length of a test (runtime.serving); a worker the
    test made is shut down after it (its warm copies closed), the session's embedded one is kept."""
    routed: list[Worker] = []

    def route(worker: Worker) -> Worker:
        routed.append(worker)
        return serving.enter_context(runtime.serving(worker))

    with ExitStack() as serving:
        yield route
    session_worker = runtime.in_process_worker()
    for worker in routed:
        if worker is not session_worker:
            worker.shutdown()


def staged(worker: Worker) -> Worker:
    """The worker started, its startup staging done."""
    worker.start()
    assert worker.wait_ready(60), "startup staging did not finish"
    return worker


@pytest.fixture
def serve(use_worker: Any) -> Iterator[Any]:
    """Start a Worker on a config, staged, with the views routed to it; shut down after the test."""
    started: list[Worker] = []

    def start(config: HypnosConfig) -> Worker:
        worker = staged(use_worker(Worker(config)))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.shutdown()


@pytest.fixture(scope="module")
def module_workers() -> Iterator[Callable[[HypnosConfig], Worker]]:
    """Workers a module's tests share, one per config (compared by value): each started and
    staged at the first test that asks for it, shut down after the module's last test. For tests
    that leave their worker as they found it (a refusal, a checked schema); serve() starts a
    fresh worker per test (0.2-0.3 s each, 72 times in the grammar module alone)."""
    workers: dict[str, Worker] = {}

    def start(config: HypnosConfig) -> Worker:
        key = config.model_dump_json()
        if key not in workers:
            workers[key] = staged(Worker(config))
        return workers[key]

    yield start
    for worker in workers.values():
        worker.shutdown()


@pytest.fixture
def serve_shared(module_workers: Callable[[HypnosConfig], Worker]) -> Iterator[Callable[[HypnosConfig], Worker]]:
    """serve() on the module's shared worker of the config (module_workers): the views are routed
    to it for this test, and it stays up for the next."""
    with ExitStack() as serving:
        yield lambda config: serving.enter_context(runtime.serving(module_workers(config)))


@contextmanager
def queue_filled(worker: Worker, model: str, count: int) -> Iterator[None]:
    """As if `count` more requests were queued or running on `model`: counted under the
    worker's lock, as the worker counts its own, so a request ending meanwhile loses no count."""
    runtime = worker.models[model]
    with worker._lock:
        runtime.admitted += count
    try:
        yield
    finally:
        with worker._lock:
            runtime.admitted -= count


def with_limits(settings: Any, **limits: Any) -> HypnosConfig:
    config: HypnosConfig = settings.HYPNOS
    settings.HYPNOS = config.model_copy(update={"limits": config.limits.model_copy(update=limits)})
    return settings.HYPNOS


def with_server(settings: Any, **server: Any) -> HypnosConfig:
    config: HypnosConfig = settings.HYPNOS
    settings.HYPNOS = config.model_copy(update={"server": config.server.model_copy(update=server)})
    return settings.HYPNOS


async def post_json(api: AsyncClient, path: str, body: Any, **headers: str) -> Any:
    return await api.post(path, data=json.dumps(body), content_type="application/json", headers=headers)


async def read_sse(response: Any) -> list[Any]:
    """The data payloads of an SSE body, `[DONE]` kept as the string."""
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def read_in_background(response: Any) -> tuple[asyncio.Task[None], list[bytes]]:
    """Consume a streaming response in a task, the way Django's ASGI handler does; cancelling
    the task is what a client disconnect does to the response."""
    chunks: list[bytes] = []

    async def consume() -> None:
        async for chunk in response.streaming_content:
            chunks.append(chunk)

    return asyncio.create_task(consume()), chunks


async def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()
