"""The worker's side of the channel-layer transport (`manage.py runinference`).

Every running request's reply channel gets a `heartbeat` whenever HEARTBEAT_SECS pass with
nothing else sent, so the web process tells a slow engine from a dead worker
(inference/transport/client.py REPLY_DEADLINE_SECS). A reply that cannot be sent (Redis gone) stops the
request: nobody could read the rest.

With several workers (inference/transport/cluster.py) each announces itself in Redis while it serves; the
web processes route a request to one worker's own channel, and the shared channel takes what is
sent before any announcement. On SIGTERM the worker withdraws its announcement and stops taking
requests, lets the running ones finish (up to DRAIN_SECS), then stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from typing import Any

from pydantic import ValidationError

from hypnos_site.errors import InvalidRequest
from inference.transport.client import REQUEST_CHANNEL
from inference.transport.cluster import ANNOUNCE_SECS, Announcer, running_elsewhere
from inference.transport.deadline import within
from inference.transport.wire import (
    TERMINAL,
    Accepted,
    Delta,
    Done,
    Error,
    Heartbeat,
    Queued,
    Started,
    decode_request,
    encode_event,
)
from inference.worker.core import Worker

log = logging.getLogger(__name__)
# After a request's first delta, the deltas that come within this long go as one message.
DELTA_BATCH_SECS = 0.005
RECEIVE_RETRY_SECS = 1.0
HEARTBEAT_SECS = 0.5
# How long a stopping worker lets its running requests finish.
DRAIN_SECS = 30.0


class DuplicateWorker(RuntimeError):
    """Another live worker on this host announces itself with this worker's id."""


class ChannelServer:
    """Receives requests from the shared channel, aborts on its own channel, and streams
    each request's events back in order on the request's reply channel."""

    def __init__(self, worker: Worker, layer: Any, announce: bool = True, drain_secs: float = DRAIN_SECS):
        self.worker = worker
        self.layer = layer
        self.own_channel = ""
        self.announcer: Announcer | None = None
        self.announce = announce
        self.drain_secs = drain_secs
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        self.own_channel = await self.layer.new_channel("hypnos.worker.")
        worker_id = self.worker.worker_id
        if self.announce:
            other = await running_elsewhere(worker_id, socket.gethostname(), os.getpid())
            if other is not None:
                raise DuplicateWorker(
                    f"the worker {worker_id!r} already runs on this host (pid {other.pid}); "
                    "give each worker its own HYPNOS_WORKER_ID"
                )
            self.announcer = Announcer(worker_id)
        log.info("inference worker %s listening on %s and %s", worker_id, REQUEST_CHANNEL, self.own_channel)
        shared = asyncio.create_task(self._receive_loop(REQUEST_CHANNEL))
        own = asyncio.create_task(self._receive_loop(self.own_channel))
        announcing = asyncio.create_task(self._announce_loop()) if self.announcer is not None else None
        await stop.wait()
        # Stop being chosen, stop taking requests; aborts still arrive on the own channel.
        self.draining = True
        shared.cancel()
        if announcing is not None:
            announcing.cancel()
        if self.announcer is not None:
            try:
                await within(self.announcer.withdraw(), 2.0)
            except Exception:
                log.warning("could not withdraw the announcement of %s", worker_id, exc_info=True)
        if self._tasks:
            log.info("letting %d running request(s) finish (up to %.0f s)", len(self._tasks), self.drain_secs)
            await asyncio.wait(set(self._tasks), timeout=self.drain_secs)
        own.cancel()
        await asyncio.gather(shared, own, *([announcing] if announcing else []), return_exceptions=True)

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self._announce(force=True)
            except Exception as exc:
                # Redis away: the announcement lapses and the web processes stop choosing this
                # worker until it comes back.
                log.warning("announcing %s failed: %s", self.worker.worker_id, exc)
            await asyncio.sleep(ANNOUNCE_SECS)

    async def _announce(self, force: bool) -> None:
        """Announce what the worker holds now: built off the event loop (the tier ledger's
        lock), sent on it."""
        announcer = self.announcer
        if announcer is None or not (force or announcer.due()):
            return
        built = await asyncio.to_thread(self.worker.announcement, self.own_channel, self.draining)
        await announcer.announce(built)

    def _moved(self) -> None:
        """A request started or ended: what the worker holds may have changed."""
        if self.announcer is not None and not self.draining:
            self._track(asyncio.create_task(self._announce_quietly()))

    async def _announce_quietly(self) -> None:
        try:
            await self._announce(force=False)
        except Exception as exc:
            log.warning("announcing %s failed: %s", self.worker.worker_id, exc)

    async def _receive_loop(self, channel: str) -> None:
        while True:
            try:
                message = await self.layer.receive(channel)
            except Exception:
                # Redis went away or hiccuped: keep listening rather than go deaf.
                log.exception("receiving on %s failed; retrying in %.0f s", channel, RECEIVE_RETRY_SECS)
                await asyncio.sleep(RECEIVE_RETRY_SECS)
                continue
            try:
                await self._dispatch(message)
            except Exception:
                log.exception("could not handle %s", message.get("type"))

    async def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "inference.abort":
            self.worker.abort(message["request_id"])
            return
        if message.get("ack_deadline", 0) < time.time():
            log.warning("dropping %s %s: the web process stopped waiting for it", kind, message.get("request_id", ""))
            return
        if kind == "inference.request":
            if self.draining:
                # Stopping: the web process's acknowledgement wait sends it to another worker.
                log.info("stopping: not taking %s", message.get("request_id", ""))
                return
            self._track(asyncio.create_task(self._run(message)))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, message: dict[str, Any]) -> None:
        try:
            await self._relay(message)
        except Exception:
            # The reply channel is unreachable: stop the engine instead of running for nobody.
            log.exception("request %s: replies cannot be sent; aborting it", message.get("request_id", ""))
            self.worker.abort(message.get("request_id", ""))

    async def _relay(self, message: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        reply = message["reply_channel"]
        seq = 0

        async def send(events: list[Any]) -> None:
            """One message for the events ready together (a max_tokens 1 call's queued, started,
            delta and done are usually one), numbered so the web process sees a lost one."""
            nonlocal seq
            await self.layer.send(reply, {"seq": seq, "events": [encode_event(self._stamped(e)) for e in events]})
            seq += 1
            if any(isinstance(e, (Started, *TERMINAL)) for e in events):
                self._moved()

        accepted = Accepted(worker_channel=self.own_channel)
        try:
            request = decode_request(message["request"])
        except (KeyError, ValidationError) as exc:
            await send([accepted, Error.of(InvalidRequest(f"malformed worker request: {exc}"))])
            return

        def sink(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        self.worker.submit(request, sink)
        streaming = False
        # `accepted` goes with the first events (the admission's queued or refusal, which the
        # worker answers at once): one message fewer per request.
        pending: list[Any] = [accepted]
        while True:
            try:
                first = await within(queue.get(), HEARTBEAT_SECS)
            except TimeoutError:
                await send([*pending, Heartbeat()])
                pending = []
                continue
            batch = _take_ready([*pending, first], queue)
            pending = []
            if isinstance(batch[-1], Queued):
                # One turn of the loop, so that what the engine's thread handed over meanwhile
                # (a warm model's `started`) shares the message. Waiting longer for it cost
                # more than the message it saved (bench/server_cost.py: 2 ms gave +1.4 ms p50).
                await asyncio.sleep(0)
                batch = _take_ready(batch, queue)
            if streaming and isinstance(batch[-1], Delta):
                # Deltas are flowing: wait a moment for more to share the message. The first goes
                # at once (it is the client's time to first token), and so does one the end follows.
                await asyncio.sleep(DELTA_BATCH_SECS)
                batch = _take_ready(batch, queue)
            streaming = streaming or any(isinstance(e, Delta) for e in batch)
            await send(batch)
            if isinstance(batch[-1], TERMINAL):
                return

    def _stamped(self, event: Any) -> Any:
        """A request's end says which worker served it (hypnos_telemetry.worker)."""
        if isinstance(event, Done):
            return dataclasses.replace(event, telemetry={**event.telemetry, "worker": self.worker.worker_id})
        return event


def _take_ready(first: Any, queue: asyncio.Queue[Any]) -> list[Any]:
    """`first` (an event or a batch) with every event already queued behind it, consecutive
    deltas joined into one, up to and including a terminal event."""
    batch = list(first) if isinstance(first, list) else [first]
    while not isinstance(batch[-1], TERMINAL) and not queue.empty():
        event = queue.get_nowait()
        if isinstance(event, Delta) and isinstance(batch[-1], Delta):
            batch[-1] = batch[-1].joined(event)
        else:
            batch.append(event)
    return batch
