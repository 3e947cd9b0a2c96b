"""The InferenceClient: the only way views reach the worker, over one of two transports.

- `InProcessTransport` (embedded): the worker lives in this process; events cross from its
  threads into the caller's event loop.
- `ChannelLayerTransport` (distributed): requests go to the `hypnos.inference` channel that every
  `manage.py runinference` listens on; events come back on a per-request reply channel, numbered,
  so a lost message is an error and not a silent gap. A worker that does not acknowledge within
  `server.worker_ack_timeout_secs` is a 503, never a hang; once it has, it sends a heartbeat on
  the reply channel of every running request, and a worker silent for REPLY_DEADLINE_SECS whose
  announcement has lapsed as well (killed, crashed, cut off) ends the request with the same 503
  (in a stream: an error chunk). A worker that still announces itself is busy, not gone: a loaded
  machine can starve its event loop past a few heartbeats, and the request waits on for it.

Once the engine runs, a request that gets no event for `limits.request_timeout_secs` (a stalled
engine) ends with 504 `timeout` (spec §4: the engine-side timeout; the 408 of the timeout layer
covers what happens before the response starts).

Both carry the typed messages of inference/transport/wire.py (the in-process transport as objects, the
channel layer through wire's serialiser), so both deployments run the same worker code. The call
is where the worker's events meet the HTTP request: `events()` turns an error event into its
typed exception (the one place) and fills the request's CallRecord, `drain()` runs a call to its
end, and `async with call` aborts it when the caller leaves early.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis.exceptions import RedisError

from hypnos_site.errors import EngineTimeout, HypnosError, InvalidRequest, ModelNotAvailable, ServerError
from inference.transport.cluster import ANNOUNCE_SECS, WorkerDirectory, merge_kv_park, merge_memory_status, merge_status
from inference.transport.deadline import within
from inference.transport.entities import Span
from inference.transport.transcripts import Transcript
from inference.transport.wire import (
    TERMINAL,
    Accepted,
    AudioChunk,
    ControlOp,
    ControlRequest,
    Delta,
    Done,
    Embedded,
    EngineRequest,
    EntitiesFound,
    Error,
    Heartbeat,
    Queued,
    Reasoning,
    Result,
    Started,
    VectorChunk,
    WorkerAnnouncement,
    decode_event,
    encode_request,
)
from logs.record import CallRecord

log = logging.getLogger(__name__)

Event = Any  # one of inference.transport.wire's event types
REQUEST_CHANNEL = "hypnos.inference"
# A status is answered at once; this bounds a worker that accepted it and then stalled.
STATUS_TIMEOUT_SECS = 10.0
NO_WORKER = "No inference worker answered within {secs:g} s; start one with `manage.py runinference`."
# The worker sends a heartbeat every HEARTBEAT_SECS (channel_server.py) on the reply channel of
# a request that has nothing else to send; three missed ones make the worker suspect. It is lost
# once its announcement (inference/transport/cluster.py, renewed every ANNOUNCE_SECS by the same event loop)
# has lapsed too: at most ANNOUNCE_TTL_SECS after a kill, and never while the worker still
# announces itself (busy: its heartbeats late on a loaded machine). The announcement is looked
# at again every ANNOUNCE_SECS meanwhile.
REPLY_DEADLINE_SECS = 1.5
# A worker that announces itself but sends this request nothing for this long is lost even so:
# its event loop runs (it announces), so this request's relay is stuck.
SILENCE_CAP_SECS = 10.0
# An abort that could not be sent (Redis down) is sent again every ABORT_RETRY_SECS, for as long
# as a reply nobody reads stays in Redis (channels_redis's message expiry, 60 s).
ABORT_RETRY_SECS = 0.5
ABORT_RETRY_FOR_SECS = 60.0
# The aborts being retried: a task is kept until it ends (asyncio keeps only a weak reference).
_aborts_retrying: set[asyncio.Task[None]] = set()
WORKER_LOST = (
    "The inference worker stopped answering (nothing for {secs:g} s); it is being restarted or is gone. Retry shortly."
)
STALLED = "The engine produced nothing for {secs:g} s (limits.request_timeout_secs); the request was stopped."
# Set in the task of an HTTP request whose status call (the pool refresh) found no worker, so
# that the request itself answers at once instead of waiting worker_ack_timeout_secs a second
# time; the message and when. A long-lived task (a realtime session) retries after NO_WORKER_MEMO_SECS.
_no_worker_seen: contextvars.ContextVar[tuple[str, float] | None] = contextvars.ContextVar(
    "hypnos_no_worker_seen", default=None
)
NO_WORKER_MEMO_SECS = 1.0


class InferenceCall(ABC):
    """One request in flight: its events in order, and a way to stop it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        # The worker's estimate, made when it admitted the request (x-hypnos-estimated-wait-ms).
        self.estimated_wait_ms: float | None = None
        # Once the engine has produced its first event: the longest wait for the next one before
        # a 504 (None: no bound). The wait for the first (the prompt's evaluation, however long)
        # is not bounded here: spec §4's request_timeout_secs covers the time to the response
        # headers (the timeout layer's 408), and a stream's body runs as long as max_tokens takes.
        self.stall_timeout: float | None = None
        # The HTTP request's record, filled as the events go by (None: nobody accounts for it).
        self.record: CallRecord | None = None

    @abstractmethod
    async def next_event(self) -> Event: ...

    @abstractmethod
    async def abort(self) -> None: ...

    async def events(self) -> AsyncIterator[Event]:
        """Every event until the terminal Done (included), noted in the call's record. An Error
        event raises its typed exception; an engine that falls silent for `stall_timeout` after
        its first event is stopped and raises EngineTimeout (504)."""
        record = self.record
        first = True
        try:
            while not self.finished:
                try:
                    event = await within(self.next_event(), None if first else self.stall_timeout)
                    first = False
                except TimeoutError:
                    await self.abort()
                    raise EngineTimeout(STALLED.format(secs=self.stall_timeout)) from None
                if isinstance(event, TERMINAL):
                    self.finished = True
                    if isinstance(event, Error):
                        raise event.exception()
                if record is not None:
                    _note(record, event)
                yield event
        except HypnosError as exc:
            if record is not None:
                record.note_error(exc.message, exc.type)
            raise

    async def drain(self) -> Drained:
        """Run the call to its end: its text, thoughts, logprobs, vectors, audio, entities and Done."""
        text: list[str] = []
        drained = Drained(Done())
        async with self:
            async for event in self.events():
                if isinstance(event, Delta):
                    text.append(event.text)
                    if event.logprobs:
                        drained.logprobs += event.logprobs
                elif isinstance(event, Reasoning):
                    drained.reasoning += event.text
                elif isinstance(event, VectorChunk):
                    drained.vectors += event.data
                elif isinstance(event, AudioChunk):
                    drained.audio.append(event.data)
                elif isinstance(event, EntitiesFound):
                    drained.entities.setdefault(event.index, []).extend(event.spans)
                elif isinstance(event, Done):
                    drained.done, drained.text = event, "".join(text)
                    return drained
        raise ServerError("the inference worker ended the request without a result")

    async def close(self) -> None:
        """Abort the call unless it ended; runs to its end even when the caller is cancelled."""
        if not self.finished:
            await asyncio.shield(self.abort())

    async def __aenter__(self) -> InferenceCall:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@dataclass
class Drained:
    """A call run to its end (InferenceCall.drain)."""

    done: Done
    text: str = ""
    reasoning: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    vectors: list[bytes] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    # The spans of each input text, by its index.
    entities: dict[int, list[Span]] = field(default_factory=dict)


def _note(record: CallRecord, event: Event) -> None:
    if isinstance(event, Delta):
        record.deltas += event.tokens
        record.output.add(event.text)
    elif isinstance(event, Reasoning):
        record.deltas += 1
    elif isinstance(event, Done):
        if event.usage is not None:
            record.note_usage(event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
        elif isinstance(event.result, Embedded):
            record.note_usage(event.result.prompt_tokens, 0, 0)
        if isinstance(event.result, Transcript):
            record.output.add(event.result.text)
        record.finish_reason = event.finish_reason
        record.note_telemetry(event.telemetry)


class Transport(ABC):
    @abstractmethod
    async def submit(self, request: EngineRequest | ControlRequest) -> InferenceCall: ...


class InferenceClient:
    def __init__(self, transport: Transport):
        self.transport = transport

    async def start(self, request: EngineRequest, record: CallRecord | None = None) -> tuple[InferenceCall, Started]:
        """Submit a request and wait until the worker has started it (model loaded, engine
        running). Raises the typed error when the worker refuses it, so that every 4xx/5xx
        is known before a streaming response sends its first byte."""
        missing = _no_worker_seen.get()
        if missing is not None:
            _no_worker_seen.set(None)
            if time.monotonic() - missing[1] < NO_WORKER_MEMO_SECS:
                raise ModelNotAvailable(missing[0])
        call = await self.transport.submit(request)
        try:
            event = await call.next_event()
            if isinstance(event, Queued):
                call.estimated_wait_ms = event.estimated_wait_ms
                event = await call.next_event()
        except BaseException:
            await call.abort()
            raise
        if not isinstance(event, Started):
            call.finished = True
            error = (
                event.exception()
                if isinstance(event, Error)
                else ServerError(f"the inference worker answered {event.kind!r} before starting the request")
            )
            if record is not None:
                record.note_error(error.message, error.type)
            raise error
        call.stall_timeout = request_timeout_secs()
        call.record = record
        return call, event

    async def control(self, op: ControlOp, args: dict[str, Any] | None = None) -> Any:
        """A control operation of the worker (status, memory_status, move): its one result.
        One that takes longer than limits.request_timeout_secs (a load that hangs) is a 504.
        With several workers it goes to each one it concerns (cluster.py), and their statuses
        come back as one."""
        try:
            request = ControlRequest(request_id=new_request_id(), op=op, args=args or {})
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(p) for p in error["loc"]) or None
            raise InvalidRequest(f"Invalid value for {param or op}: {error['msg']}", param=param) from exc
        transport = self.transport
        if isinstance(transport, ChannelLayerTransport):
            targets = await _guarded(transport.directory.control_targets(request))
            if targets is not None:
                return await self._fan_out(transport, request, targets)
        result = await self._result(await transport.submit(request), op)
        return merge_memory_status([result]) if op == "memory_status" else result

    async def _fan_out(
        self, transport: ChannelLayerTransport, request: ControlRequest, targets: list[WorkerAnnouncement]
    ) -> Any:
        if not targets:
            raise InvalidRequest(f"No worker {request.args.get('worker')!r} announces itself.", param="worker")

        async def one(worker: WorkerAnnouncement, request_id: str) -> Any:
            call = await transport.send(request.model_copy(update={"request_id": request_id}), worker)
            try:
                return await self._result(call, request.op)
            except ModelNotAvailable:
                if call.worker_channel is None:  # never acknowledged: gone
                    transport.directory.lost(worker.channel)
                raise

        ids = [request.request_id, *(new_request_id() for _ in targets[1:])]
        results = await asyncio.gather(*(one(w, i) for w, i in zip(targets, ids, strict=True)), return_exceptions=True)
        answered = [r for r in results if not isinstance(r, BaseException)]
        answered_by = [w.worker_id for w, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        for failure in failed:
            # A worker that is gone (its announcement not yet lapsed) leaves the answer to the others.
            if not isinstance(failure, ModelNotAvailable | EngineTimeout) or not answered:
                raise failure
        if request.op == "status":
            return merge_status(answered)
        if request.op == "memory_status":
            return merge_memory_status(answered)
        if request.op == "kv_park":
            return merge_kv_park(answered, answered_by)
        return answered[0]

    async def _result(self, call: InferenceCall, op: str) -> Any:
        timeout = request_timeout_secs()
        try:
            event = await within(call.next_event(), timeout)
        except TimeoutError:
            raise EngineTimeout(
                f"The worker's {op} took longer than limits.request_timeout_secs ({timeout:g} s)."
            ) from None
        finally:
            call.finished = True
        if isinstance(event, Error):
            raise event.exception()
        if not isinstance(event, Result):
            raise ServerError(f"the inference worker answered {op} with {event.kind!r}")
        return event.result

    async def status(self) -> dict[str, Any] | None:
        """The worker's status, or None when no worker answers (then a request made next in the
        same task fails at once with the same 503)."""
        try:
            return await within(self.control("status"), STATUS_TIMEOUT_SECS)
        except (TimeoutError, ModelNotAvailable) as exc:
            message = exc.message if isinstance(exc, ModelNotAvailable) else NO_WORKER.format(secs=STATUS_TIMEOUT_SECS)
            _no_worker_seen.set((message, time.monotonic()))
            return None


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


def request_timeout_secs() -> float | None:
    """limits.request_timeout_secs, read at call time (tests change the settings)."""
    from django.conf import settings

    if not settings.configured:
        return None
    return float(settings.HYPNOS.limits.request_timeout_secs)


class _QueueCall(InferenceCall):
    def __init__(self, request_id: str, queue: asyncio.Queue[Event]):
        super().__init__(request_id)
        self.queue = queue

    async def next_event(self) -> Event:
        return await self.queue.get()


class InProcessTransport(Transport):
    def __init__(self, worker: Any):
        self.worker = worker

    async def submit(self, request: EngineRequest | ControlRequest) -> InferenceCall:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        request_id = request.request_id
        # Events the worker sent since the event loop last took them: one wake-up of the loop
        # takes them all, consecutive deltas joined, so a loop busy with other streams is not
        # woken once per token per stream. When it keeps up, every event goes at once.
        pending: list[Event] = []
        lock = threading.Lock()

        def hand_over() -> None:
            with lock:
                events = pending[:]
                pending.clear()
            for event in events:
                queue.put_nowait(event)

        def sink(event: Event) -> None:
            if loop.is_closed():  # nobody reads this any more (a hand-over may never have run)
                self.worker.abort(request_id)
                return
            with lock:
                if pending and isinstance(event, Delta) and isinstance(pending[-1], Delta):
                    pending[-1] = pending[-1].joined(event)
                    return
                pending.append(event)
                if len(pending) > 1:
                    return  # the hand-over already scheduled takes this one too
            try:
                loop.call_soon_threadsafe(hand_over)
            except RuntimeError:  # the caller's event loop is gone: nobody reads this any more
                self.worker.abort(request_id)

        call = _InProcessCall(request_id, queue, self.worker)
        self.worker.submit(request, sink)
        return call


class _InProcessCall(_QueueCall):
    def __init__(self, request_id: str, queue: asyncio.Queue[Event], worker: Any):
        super().__init__(request_id, queue)
        self.worker = worker

    async def abort(self) -> None:
        self.worker.abort(self.request_id)


class ChannelLayerTransport(Transport):
    """Requests go to the worker the directory routes them to (inference/transport/cluster.py), or to the
    shared channel while no worker announces itself."""

    def __init__(self, layer: Any, ack_timeout_secs: float, directory: WorkerDirectory | None = None):
        self.layer = layer
        self.ack_timeout = ack_timeout_secs
        self.directory = directory if directory is not None else WorkerDirectory()

    async def submit(self, request: EngineRequest | ControlRequest) -> InferenceCall:
        if isinstance(request, EngineRequest):
            worker = await self._route(request.model, frozenset())
            return await self.send(request, worker)
        return await self.send(request, None)

    async def _route(self, model: str, exclude: frozenset[str]) -> WorkerAnnouncement | None:
        try:
            return await self.directory.route(model, exclude)
        except (OSError, RedisError) as exc:
            raise ModelNotAvailable(f"The channel layer is unreachable: {type(exc).__name__}: {exc}") from exc

    async def send(self, request: EngineRequest | ControlRequest, worker: WorkerAnnouncement | None) -> _ChannelCall:
        """Send `request` to `worker`'s own channel (None: the shared one)."""
        call = _ChannelCall(request.request_id, self.layer, "", self.ack_timeout, self.directory)
        await self._send(call, request, worker, frozenset())
        return call

    async def _send(
        self,
        call: _ChannelCall,
        request: EngineRequest | ControlRequest,
        worker: WorkerAnnouncement | None,
        tried: frozenset[str],
    ) -> None:
        # With other workers alive, one that does not acknowledge within the reply deadline and
        # no longer announces itself is taken for lost (a live worker acknowledges within a
        # heartbeat): a request for a model goes to the next one, a control operation is answered
        # by the others or is a 503. One that still announces itself has the whole ack timeout.
        others = worker is not None and len(await self.directory.live()) > 1
        ack = min(self.ack_timeout, REPLY_DEADLINE_SECS) if others else self.ack_timeout
        reply = await _guarded(self.layer.new_channel("hypnos.reply."))
        message = {
            "type": "inference.request",
            "reply_channel": reply,
            # A worker that picks this up after the web gave up drops it instead of running it.
            "ack_deadline": time.time() + self.ack_timeout,
            "request_id": request.request_id,
            "request": encode_request(request),
        }
        await _guarded(self.layer.send(worker.channel if worker is not None else REQUEST_CHANNEL, message))
        call.reply, call.ack_timeout, call.expected_seq = reply, ack, 0
        call.worker, call.heard_at = worker, time.monotonic()
        if not others or not isinstance(request, EngineRequest):
            call.no_ack = None
            return
        assert worker is not None
        tried = tried | {worker.channel}

        async def elsewhere() -> bool:
            log.warning(
                "request %s: worker %s did not acknowledge it within %.1f s; trying another",
                request.request_id,
                worker.worker_id,
                ack,
            )
            self.directory.lost(worker.channel)
            fallback = await self._route(request.model, tried)
            if fallback is None or fallback.channel in tried:
                return False
            await self._send(call, request, fallback, tried)
            return True

        call.no_ack = elsewhere


class _ChannelCall(InferenceCall):
    def __init__(
        self, request_id: str, layer: Any, reply: str, ack_timeout: float, directory: WorkerDirectory | None = None
    ):
        super().__init__(request_id)
        self.layer, self.reply, self.ack_timeout = layer, reply, ack_timeout
        # Before an acknowledgement, a worker that still announces itself is waited for this long.
        self.ack_limit = ack_timeout
        self.directory = directory
        # The worker the request was routed to (None: the shared channel), and when it was last
        # heard from (or the request sent).
        self.worker: WorkerAnnouncement | None = None
        self.heard_at = time.monotonic()
        self.worker_channel: str | None = None
        self.expected_seq = 0
        self._ready: deque[Event] = deque()
        # Before the worker acknowledged: sends the request to another worker (False: none left).
        self.no_ack: Callable[[], Awaitable[bool]] | None = None

    async def next_event(self) -> Event:
        """The next event of the request; heartbeats are taken here and never returned. Before
        the worker accepted the request it has `ack_timeout`, then REPLY_DEADLINE_SECS between
        two messages, to answer; after that, unless it still announces itself (`_busy`), the
        request is a 503 (or, not yet accepted, goes to another worker). A message carries the
        events that were ready together; they are handed out one by one."""
        # Silence counts from now (the caller may have been slow to ask) or the last message.
        self.heard_at = time.monotonic()
        while True:
            if self._ready:
                event = self._ready.popleft()
                if isinstance(event, Accepted):
                    self.worker_channel = event.worker_channel
                    self.no_ack = None
                    continue
                if isinstance(event, Heartbeat):
                    continue
                return event
            accepted = self.worker_channel is not None
            deadline = REPLY_DEADLINE_SECS if accepted else self.ack_timeout
            silent = time.monotonic() - self.heard_at
            # Suspect already: look at its announcement again soon.
            wait = deadline - silent if silent < deadline else ANNOUNCE_SECS
            try:
                message = await within(_guarded(self.layer.receive(self.reply)), wait)
            except TimeoutError:
                if await self._busy(accepted):
                    continue
                if not accepted and self.no_ack is not None and await self.no_ack():
                    continue
                silent = round(time.monotonic() - self.heard_at, 1)
                raise ModelNotAvailable((WORKER_LOST if accepted else NO_WORKER).format(secs=silent)) from None
            self.heard_at = time.monotonic()
            if message.get("seq") != self.expected_seq:
                raise ServerError(
                    f"reply {self.expected_seq} from the inference worker was lost (got {message.get('seq')})"
                )
            self.expected_seq += 1
            self._ready.extend(decode_event(data) for data in message["events"])

    async def _busy(self, accepted: bool) -> bool:
        """Whether the worker, silent past its deadline, is to be waited for: it still announces
        itself (alive, its replies late), and has not been silent past the limit (SILENCE_CAP_SECS;
        before it accepted the request, the whole ack timeout, which the request carries)."""
        limit = SILENCE_CAP_SECS if accepted else self.ack_limit
        if self.worker is None or self.directory is None or time.monotonic() - self.heard_at >= limit:
            return False
        if accepted and self.worker_channel != self.worker.channel:
            return False
        return await self.directory.announces(self.worker)

    async def abort(self) -> None:
        """Tell the worker to stop the request. Never raises: it runs in the `finally` of the
        serving code, where a failure would replace the error the client must get."""
        if self.worker_channel is None or self.finished:
            return
        self.finished = True
        abort = {"type": "inference.abort", "request_id": self.request_id}
        try:
            await within(_guarded(self.layer.send(self.worker_channel, abort)), REPLY_DEADLINE_SECS)
        except (ModelNotAvailable, TimeoutError) as exc:
            log.warning(
                "request %s: the abort did not reach the worker: %s; trying again for up to %g s",
                self.request_id,
                exc,
                ABORT_RETRY_FOR_SECS,
            )
            task = asyncio.get_running_loop().create_task(_send_abort_later(self.layer, self.worker_channel, abort))
            _aborts_retrying.add(task)
            task.add_done_callback(_aborts_retrying.discard)


async def _send_abort_later(layer: Any, channel: str, abort: dict[str, Any]) -> None:
    """Send an abort that Redis refused until it gets through, for up to ABORT_RETRY_FOR_SECS.
    A worker whose replies still reach Redis (its own sends retry through a short outage) would
    otherwise generate to max_tokens for a client that is gone, holding the model's slot while
    the requests after it wait."""
    deadline = time.monotonic() + ABORT_RETRY_FOR_SECS
    while time.monotonic() < deadline:
        await asyncio.sleep(ABORT_RETRY_SECS)
        try:
            await within(_guarded(layer.send(channel, abort)), REPLY_DEADLINE_SECS)
        except (ModelNotAvailable, TimeoutError):
            continue
        log.info("request %s: the abort reached the worker on a later try", abort["request_id"])
        return
    log.warning("request %s: the abort never reached the worker", abort["request_id"])


async def _guarded(operation: Awaitable[Any]) -> Any:
    """A channel-layer operation whose failure (Redis down, a dropped connection) becomes the
    spec's 503 instead of an unhandled exception."""
    try:
        return await operation
    except (OSError, RedisError) as exc:
        raise ModelNotAvailable(f"The channel layer is unreachable: {type(exc).__name__}: {exc}") from exc
