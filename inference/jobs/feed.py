"""Long jobs: how a web process hands a job to Celery and follows it, and how the job reports.

A job's progress travels as the typed events of inference/transport/wire.py on a channel the waiting
request opened, numbered like the inference worker's replies (a lost message is an error, not a
silent gap):

- distributed: the channel layer (Redis). The Celery worker (`./run.sh jobs`) sends, the daphne
  process that holds the HTTP request receives;
- embedded: the task runs eagerly on a thread of the server process, and the feed is a
  process-local channel (LocalChannels) that hands events to the request's event loop.

A running job sends a heartbeat every HEARTBEAT_SECS; a feed that hears nothing for
server.job_silence_secs (the Celery worker was killed, the task crashed hard) ends with JobLost (503)
instead of hanging, and the web process marks the job failed. A job that no Celery worker takes
within server.job_pickup_timeout_secs is revoked and the request is a 503. The client leaving
marks the job cancelled in the database; the task watches that flag (CANCEL_POLL_SECS) and stops
the conversion at its next page.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from hypnos_site.errors import Cancelled, HypnosError, JobLost, ModelNotAvailable, ServerError
from inference.transport.deadline import within
from inference.transport.wire import Done, Error, Heartbeat, decode_event, encode_event
from logs.record import CallRecord

log = logging.getLogger(__name__)

HEARTBEAT_SECS = 1.0
CANCEL_POLL_SECS = 0.25
NO_JOB_WORKER = (
    "No job worker took the conversion within {secs:g} s (server.job_pickup_timeout_secs); "
    "start one with `./run.sh jobs`."
)
JOB_LOST = "The job stopped reporting (nothing for {secs:g} s); its Celery worker is gone or failed."


class LocalChannels:
    """The embedded deployment's job channels: a task thread sends, the event loop of the
    request that opened the channel receives. Thread-safe, unlike the in-memory channel layer
    (whose queues belong to one event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[dict[str, Any]]]] = {}

    async def new_channel(self, prefix: str = "hypnos.job.") -> str:
        name = prefix + uuid.uuid4().hex
        with self._lock:
            self._channels[name] = (asyncio.get_running_loop(), asyncio.Queue())
        return name

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        with self._lock:
            target = self._channels.get(channel)
        if target is None:  # the request is gone: nobody reads this any more
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, message)
        except RuntimeError:  # its event loop closed
            self.discard(channel)

    async def receive(self, channel: str) -> dict[str, Any]:
        with self._lock:
            _loop, queue = self._channels[channel]
        return await queue.get()

    def discard(self, channel: str) -> None:
        with self._lock:
            self._channels.pop(channel, None)


local_channels = LocalChannels()


def job_layer() -> Any:
    """Where job progress travels in this deployment (LocalChannels or the channel layer)."""
    if settings.HYPNOS.server.deployment == "distributed":
        from channels.layers import get_channel_layer

        return get_channel_layer()
    return local_channels


class JobFeed:
    """The waiting request's side: the job's events in order, heartbeats taken here."""

    def __init__(self, layer: Any, channel: str):
        self.layer, self.channel = layer, channel
        self.expected_seq = 0
        self.started = False

    @classmethod
    async def open(cls) -> JobFeed:
        layer = job_layer()
        return cls(layer, await layer.new_channel("hypnos.job."))

    async def next_event(self) -> Any:
        """The job's next event; its first must come within the pickup timeout, the others
        within server.job_silence_secs of the last message. An Error event raises its exception."""
        while True:
            server = settings.HYPNOS.server
            wait = server.job_silence_secs if self.started else server.job_pickup_timeout_secs
            try:
                message = await within(self.layer.receive(self.channel), wait)
            except TimeoutError:
                text = JOB_LOST if self.started else NO_JOB_WORKER
                raise JobLost(text.format(secs=wait)) from None
            self.started = True
            if message.get("seq") != self.expected_seq:
                raise ServerError(
                    f"progress message {self.expected_seq} of the job was lost (got {message.get('seq')})"
                )
            self.expected_seq += 1
            event = decode_event(message["event"])
            if isinstance(event, Heartbeat):
                continue
            if isinstance(event, Error):
                raise event.exception()
            return event

    def close(self) -> None:
        if isinstance(self.layer, LocalChannels):
            self.layer.discard(self.channel)


class JobReporter:
    """The task's side: numbered events to the waiting request, a heartbeat while it works."""

    def __init__(self, layer: Any, channel: str):
        self.layer = layer
        self.channel = channel
        self.seq = 0
        self._lock = asyncio.Lock()

    async def send(self, event: Any) -> None:
        async with self._lock:
            message = {"type": "job.event", "seq": self.seq, "event": encode_event(event)}
            self.seq += 1
            await self.layer.send(self.channel, message)

    async def error(self, exc: HypnosError) -> None:
        try:
            await self.send(Error.of(exc))
        except Exception:  # the channel itself failed: the feed's silence deadline ends it
            log.exception("job: the error could not be reported")

    async def heartbeats(self) -> None:
        """Run until cancelled: a heartbeat every HEARTBEAT_SECS."""
        while True:
            await asyncio.sleep(HEARTBEAT_SECS)
            await self.send(Heartbeat())


# -- a job's life, shared by every kind of job (documents, images) ------------------------------
# `rows` is the job's Django model (logs.models.DocumentJob, ImageJob): id, state,
# cancel_requested, error, started_at and finished_at are what these helpers touch.


def start_eager(task: Any, job_id: str) -> None:
    """Run the job on a thread of this process (the embedded deployment's Celery)."""
    thread = threading.Thread(
        target=task.apply,
        kwargs={"args": (job_id,), "task_id": job_id},
        name=f"hypnos-{job_id}",
        daemon=True,
    )
    thread.start()


async def dispatch(task: Any, job_id: str) -> None:
    """Hand the job to Celery: to the broker (distributed), or eagerly on a thread of this
    process (embedded: no broker)."""
    if settings.CELERY_TASK_ALWAYS_EAGER:
        start_eager(task, job_id)
        return
    try:
        await asyncio.to_thread(task.apply_async, args=(job_id,), task_id=job_id)
    except Exception as exc:  # the broker is unreachable
        raise ModelNotAvailable(f"The job broker is unreachable: {type(exc).__name__}: {exc}") from exc


async def start(
    rows: Any,
    job_id: str,
    task: Any,
    create_row: Callable[[str], Awaitable[Any]],
    first: type,
    files: list[Path],
) -> tuple[JobFeed, Any]:
    """Start a job and wait for its first event: open the feed, create the job's row
    (`create_row(progress_channel)`), hand it to Celery, and take the first event, which must
    be a `first`. On any failure (the client left, a refusal, no job worker) the job is
    cancelled, the feed closed, and `files` (what the request spooled for the job) removed,
    unless a job that has started owns them: it removes them when it ends."""
    feed: JobFeed | None = None
    dispatched = False
    try:
        feed = await JobFeed.open()
        await create_row(feed.channel)
        await dispatch(task, job_id)
        dispatched = True
        event = await feed.next_event()
        if not isinstance(event, first):
            raise ModelNotAvailable(f"the job answered {event.kind!r} before {first.__name__}")
        return feed, event
    except BaseException:
        await cancel(rows, job_id)
        if not dispatched or await never_started(rows, job_id):
            for path in files:
                path.unlink(missing_ok=True)
        if feed is not None:
            feed.close()
        raise


async def cancel(rows: Any, job_id: str) -> None:
    """The client left or the request failed: the job stops at its next unit of work (a queued
    one never starts). Runs to its end even when the caller is cancelled."""

    def cancel_now() -> None:
        rows.objects.filter(pk=job_id, state__in=("queued", "running")).update(cancel_requested=True)
        if not settings.CELERY_TASK_ALWAYS_EAGER:
            from hypnos_site.celery import app

            app.control.revoke(job_id)

    async def cancelling() -> None:
        # Not thread-sensitive: when the client left, this outlives the request and its thread.
        await sync_to_async(cancel_now, thread_sensitive=False)()

    try:
        await asyncio.shield(cancelling())
    except Exception:  # the broker or the database is gone: the job runs on to its end
        log.exception("job %s: the cancellation did not get through", job_id)


async def never_started(rows: Any, job_id: str) -> bool:
    """After `cancel`: true when the job had not started, and now never will (its row is marked
    cancelled), so the web process removes the files it spooled for it."""
    try:
        updated = await rows.objects.filter(pk=job_id, state="queued").aupdate(
            state="cancelled", finished_at=timezone.now()
        )
    except Exception:  # the database is gone: the files stay for the job, if it ever runs
        log.exception("job %s: its state could not be read", job_id)
        return False
    return bool(updated)


async def mark_lost(rows: Any, job_id: str, message: str) -> None:
    """A job that went silent cannot say so itself: its row says it failed, for the operator."""
    await rows.objects.filter(pk=job_id, state__in=("queued", "running")).aupdate(
        state="failed", error=message, finished_at=timezone.now()
    )


async def job_events(feed: JobFeed, rows: Any, job_id: str, record: CallRecord) -> AsyncGenerator[Any, None]:
    """The job's events up to its Done (its telemetry noted in the record); leaving early
    cancels the job, and a job gone silent is marked failed."""
    finished = False
    try:
        while True:
            event = await feed.next_event()
            if isinstance(event, Done):
                finished = True
                record.note_telemetry(event.telemetry)
                yield event
                return
            yield event
    except JobLost as exc:
        record.note_error(exc.message, exc.type)
        await mark_lost(rows, job_id, exc.message)
        raise
    except HypnosError as exc:
        record.note_error(exc.message, exc.type)
        raise
    finally:
        if not finished:
            await cancel(rows, job_id)
        feed.close()


async def watched(rows: Any, job_id: str, work: Any, reporter: JobReporter) -> Any:
    """The task's side: run `work` with a heartbeat to the waiting request, stopped
    (CancelledError) as soon as the job's cancel flag is set."""
    task = asyncio.ensure_future(work)
    beat = asyncio.ensure_future(reporter.heartbeats())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CANCEL_POLL_SECS)
            if done:
                return task.result()
            if await rows.objects.filter(pk=job_id, cancel_requested=True).aexists():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise Cancelled("the client left")
    finally:
        beat.cancel()
        task.cancel()
