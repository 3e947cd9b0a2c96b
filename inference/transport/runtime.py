"""The process's inference runtime: its one InferenceClient and, in the embedded deployment, the
worker that client drives in-process.

Everything that needs the client (views, the realtime consumer, metrics, the admin catalog page
through the live pool) asks `runtime`; a test that serves through a worker of its own says so
with `runtime.serving(worker)`, the one public seam. The worker package is imported only when
the embedded worker is first needed, so a distributed web process never imports it.
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from hypnos_site.config import HypnosConfig
from inference.transport.client import ChannelLayerTransport, InferenceClient, InProcessTransport, Transport

if TYPE_CHECKING:
    from inference.worker import Worker


class InferenceRuntime:
    """The client and the embedded worker, each created on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: InferenceClient | None = None
        self._worker: Worker | None = None

    def client(self) -> InferenceClient:
        """The process's client, on the transport its deployment uses."""
        with self._lock:
            if self._client is None:
                self._client = InferenceClient(self._transport())
            return self._client

    def embedded_worker(self, config: HypnosConfig | None = None) -> Worker:
        """The in-process worker of the embedded deployment, created and started on first use
        (with `config`, default the settings' own)."""
        with self._lock:
            return self._embedded_worker(config)

    def in_process_worker(self) -> Worker | None:
        """The worker the client talks to in-process, if any (none in a distributed web process)."""
        with self._lock:
            if self._client is None:
                return self._worker
            transport = self._client.transport
            return transport.worker if isinstance(transport, InProcessTransport) else None

    def release(self) -> None:
        """Stop the embedded worker, handing back the memory of its engines, and forget the
        client: the next use starts both afresh (the test suite, once its in-process tests are
        done)."""
        with self._lock:
            worker, self._worker, self._client = self._worker, None, None
        if worker is not None:
            worker.shutdown()
            trim_heap()

    @contextmanager
    def using(self, client: InferenceClient) -> Iterator[InferenceClient]:
        """`client` for the code that runs in this context (this task and the tasks it starts)
        until the block ends: a Celery job that serves requests through the URL table on an
        event loop of its own, with a channel layer of its own (inference/jobs/batches.py)."""
        token = _context_client.set(client)
        try:
            yield client
        finally:
            _context_client.reset(token)

    @contextmanager
    def serving(self, worker: Worker) -> Iterator[Worker]:
        """Route the client to `worker` in-process until the block ends (tests: a worker with its
        own config), then back to the client before it."""
        with self._lock:
            saved = self._client
            self._client = InferenceClient(InProcessTransport(worker))
        try:
            yield worker
        finally:
            with self._lock:
                self._client = saved

    def _transport(self) -> Transport:
        from django.conf import settings

        if settings.HYPNOS.server.deployment == "distributed":
            from channels.layers import get_channel_layer

            return ChannelLayerTransport(get_channel_layer(), settings.HYPNOS.server.worker_ack_timeout_secs)
        return InProcessTransport(self._embedded_worker(None))

    def _embedded_worker(self, config: HypnosConfig | None) -> Worker:
        if self._worker is None:
            from django.conf import settings

            from inference.worker import Worker

            self._worker = Worker(config or settings.HYPNOS)
            self._worker.start()
            # Free the engines before the interpreter tears down the modules they need.
            atexit.register(self._worker.shutdown)
        return self._worker


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): the engines' many
    small allocations, freed, otherwise stay counted in the process's resident memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


runtime = InferenceRuntime()
_context_client: contextvars.ContextVar[InferenceClient | None] = contextvars.ContextVar("hypnos_client", default=None)


def get_client() -> InferenceClient:
    """The client of this context (`runtime.using`), else the process's (`runtime.client()`)."""
    return _context_client.get() or runtime.client()
