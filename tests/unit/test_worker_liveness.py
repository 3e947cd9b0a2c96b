"""A busy worker is not a lost one (inference/transport/client.py, inference/transport/cluster.py): on a loaded
machine a worker's heartbeats can come later than REPLY_DEADLINE_SECS; as long as it still
announces itself in Redis the web process waits for it, and only a worker whose announcement is
gone (killed, cut off, restarted) ends the request with a 503. The deadlines are the product's,
made small here so that the test drives them with its own clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from hypnos_site.errors import ModelNotAvailable
from inference.transport import client, cluster
from inference.transport.client import ChannelLayerTransport
from inference.transport.cluster import WorkerDirectory
from inference.transport.deadline import within
from inference.transport.wire import Accepted, ControlRequest, Heartbeat, Result, WorkerAnnouncement, encode_event
from tests.unit.test_cluster import worker

DEADLINE = 0.1  # REPLY_DEADLINE_SECS here
# The worker's silence in these tests: several deadlines.
SILENCE = 4 * DEADLINE
# SILENCE_CAP_SECS here: what a wait for a worker that announces itself would last.
CAP = 30.0
# Slack on the deadlines for a busy machine; the waits it tells apart are CAP or 60 s long.
SLACK = 5.0


def announcement(name: str) -> WorkerAnnouncement:
    """A live, ready worker of that name (test_cluster's, with its default budgets)."""
    return worker(name)


class Layer:
    """An in-memory channel layer: what the web process sends, and the worker's replies."""

    def __init__(self) -> None:
        self.queues: defaultdict[str, asyncio.Queue[dict[str, Any]]] = defaultdict(asyncio.Queue)
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def new_channel(self, prefix: str) -> str:
        return f"{prefix}!{len(self.sent)}"

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        self.sent.append((channel, message))

    async def receive(self, channel: str) -> dict[str, Any]:
        return await self.queues[channel].get()

    async def reply(self, request: dict[str, Any], seq: int, *events: Any, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        await self.queues[request["reply_channel"]].put({"seq": seq, "events": [encode_event(e) for e in events]})


class Directory(WorkerDirectory):
    """Two live workers; `announced`: the ones whose announcement has not lapsed."""

    def __init__(self, *workers: WorkerAnnouncement) -> None:
        super().__init__()
        self.workers = list(workers)
        self.announced = {w.worker_id for w in workers}
        self.lost_channels: list[str] = []

    async def live(self) -> list[WorkerAnnouncement]:
        return [w for w in self.workers if w.channel not in self.lost_channels]

    async def announces(self, worker: WorkerAnnouncement) -> bool:
        return worker.worker_id in self.announced

    def lost(self, channel: str) -> None:
        self.lost_channels.append(channel)


@pytest.fixture(autouse=True)
def small_deadlines(monkeypatch):
    monkeypatch.setattr(client, "REPLY_DEADLINE_SECS", DEADLINE)
    monkeypatch.setattr(client, "ANNOUNCE_SECS", DEADLINE / 2)
    monkeypatch.setattr(client, "SILENCE_CAP_SECS", CAP)


def status_request() -> ControlRequest:
    return ControlRequest(request_id=client.new_request_id(), op="status")


async def test_a_busy_worker_that_still_announces_itself_is_not_lost():
    a, b = announcement("a"), announcement("b")
    layer, directory = Layer(), Directory(a, b)
    call = await ChannelLayerTransport(layer, 60.0, directory).send(status_request(), a)
    (channel, request), *_ = layer.sent
    assert channel == a.channel
    # Acknowledged late (other workers are alive: the short wait), then silent for several
    # reply deadlines: a loaded machine starved its event loop. Then it answers.
    replies = (
        asyncio.create_task(layer.reply(request, 0, Accepted(worker_channel=a.channel), after=SILENCE)),
        asyncio.create_task(layer.reply(request, 1, Heartbeat(), Result(result="ok"), after=2 * SILENCE)),
    )
    event = await call.next_event()
    await asyncio.gather(*replies)
    assert event == Result(result="ok")
    assert directory.lost_channels == []


async def test_a_worker_whose_announcement_lapsed_is_lost_after_the_reply_deadline():
    a, b = announcement("a"), announcement("b")
    layer, directory = Layer(), Directory(a, b)
    call = await ChannelLayerTransport(layer, 60.0, directory).send(status_request(), a)
    (_, request), *_ = layer.sent
    await layer.reply(request, 0, Accepted(worker_channel=a.channel))
    directory.announced.clear()  # killed: its key lapses
    started = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="stopped answering"):
        await call.next_event()
    # The deadline, then the announcement looked at once: not the whole silence cap.
    assert DEADLINE <= time.monotonic() - started < DEADLINE + SLACK


async def test_a_worker_that_announces_itself_but_stays_silent_is_lost_at_the_cap(monkeypatch):
    monkeypatch.setattr(client, "SILENCE_CAP_SECS", SILENCE)
    a, b = announcement("a"), announcement("b")
    layer, directory = Layer(), Directory(a, b)
    call = await ChannelLayerTransport(layer, 60.0, directory).send(status_request(), a)
    (_, request), *_ = layer.sent
    await layer.reply(request, 0, Accepted(worker_channel=a.channel))
    started = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="stopped answering"):
        await call.next_event()
    assert SILENCE <= time.monotonic() - started < SILENCE + SLACK


async def test_an_unacknowledged_request_waits_for_a_worker_that_announces_itself_up_to_the_ack_timeout():
    a, b = announcement("a"), announcement("b")
    layer, directory = Layer(), Directory(a, b)
    ack_timeout = SILENCE
    call = await ChannelLayerTransport(layer, ack_timeout, directory).send(status_request(), a)
    (_, request), *_ = layer.sent
    # The request tells the worker how long the web waits for it: the whole ack timeout.
    assert request["ack_deadline"] >= time.time() + ack_timeout - 1
    started = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="No inference worker answered"):
        await call.next_event()
    assert ack_timeout <= time.monotonic() - started < ack_timeout + SLACK
    # Gone (its announcement lapsed): no longer waited for past the short acknowledgement wait.
    directory.announced.clear()
    call = await ChannelLayerTransport(layer, 60.0, directory).send(status_request(), a)
    started = time.monotonic()
    with pytest.raises(ModelNotAvailable, match="No inference worker answered"):
        await call.next_event()
    assert DEADLINE <= time.monotonic() - started < DEADLINE + SLACK


class Redis:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def client(self) -> Redis:
        return self

    async def get(self, key: str) -> str | None:
        if key == "down":
            raise ConnectionError("refused")
        return self.values.get(key)


async def test_a_worker_announces_itself_while_its_own_process_holds_its_key(monkeypatch):
    a = announcement("a")
    restarted = a.model_copy(update={"channel": "hypnos.worker.a!y", "pid": 2})
    values: dict[str, str] = {}
    monkeypatch.setattr(cluster, "shared_redis", lambda: Redis(values))
    directory = WorkerDirectory()
    assert not await directory.announces(a)  # lapsed or withdrawn
    values[cluster.worker_key("a")] = a.model_dump_json()
    assert await directory.announces(a)
    values[cluster.worker_key("a")] = restarted.model_dump_json()
    assert not await directory.announces(a)  # another process of the worker since
    values[cluster.worker_key("a")] = "{not json"
    assert not await directory.announces(a)
    monkeypatch.setattr(cluster, "worker_key", lambda worker_id: "down")
    assert not await directory.announces(a)  # Redis unreachable


class DownLayer(Layer):
    """A channel layer whose Redis is down (every send refused) until `down` is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connect call failed.")
        await super().send(channel, message)


async def accepted_call(layer: Layer) -> Any:
    """A call to worker "a" that the worker accepted (it runs: an abort goes to its channel)."""
    a = announcement("a")
    call = await ChannelLayerTransport(layer, 60.0, Directory(a)).send(status_request(), a)
    (_, request), *_ = layer.sent
    await layer.reply(request, 0, Accepted(worker_channel=a.channel), Heartbeat())
    with contextlib.suppress(TimeoutError):  # accepted; nothing else comes
        await within(call.next_event(), DEADLINE / 2)
    assert call.worker_channel == a.channel
    return call


def aborts(layer: Layer) -> list[tuple[str, str]]:
    return [(channel, m["request_id"]) for channel, m in layer.sent if m.get("type") == "inference.abort"]


async def test_an_abort_that_redis_refused_is_sent_again_once_redis_is_back(monkeypatch):
    """The client left while Redis was down (its stream ended with an error chunk): the worker,
    whose own sends retry through the outage, would generate to max_tokens for nobody, holding
    the model's slot while the next requests wait. The abort gets through once Redis is back."""
    monkeypatch.setattr(client, "ABORT_RETRY_SECS", DEADLINE / 2)
    layer = DownLayer()
    call = await accepted_call(layer)
    layer.down = True
    started = time.monotonic()
    await call.abort()  # never raises; returns without waiting for Redis
    assert time.monotonic() - started < DEADLINE + SLACK
    assert aborts(layer) == []
    await asyncio.sleep(4 * DEADLINE)  # still down: tried, refused, nothing sent
    assert aborts(layer) == [] and client._aborts_retrying
    layer.down = False
    deadline = time.monotonic() + SLACK
    while not aborts(layer) and time.monotonic() < deadline:
        await asyncio.sleep(DEADLINE / 4)
    assert aborts(layer) == [(call.worker_channel, call.request_id)]
    await asyncio.sleep(4 * DEADLINE)
    assert len(aborts(layer)) == 1  # once
    assert not client._aborts_retrying


async def test_an_abort_retried_while_redis_stays_down_gives_up(monkeypatch, caplog):
    monkeypatch.setattr(client, "ABORT_RETRY_SECS", DEADLINE / 2)
    monkeypatch.setattr(client, "ABORT_RETRY_FOR_SECS", 3 * DEADLINE)
    layer = DownLayer()
    call = await accepted_call(layer)
    layer.down = True
    await call.abort()
    deadline = time.monotonic() + SLACK
    while client._aborts_retrying and time.monotonic() < deadline:
        await asyncio.sleep(DEADLINE / 4)
    assert not client._aborts_retrying
    assert aborts(layer) == []
    assert "the abort never reached the worker" in caplog.text
