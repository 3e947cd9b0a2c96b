"""A stream whose client leaves is cancelled; the cancellation must never be lost, even when it
arrives as the next event does (asyncio.wait_for on Python 3.11 loses it: cpython gh-86296).
That is how CI once saw a cancelled 2000-token stream run to its end, holding its lease."""

from __future__ import annotations

import asyncio

import pytest

from inference.transport.client import _QueueCall
from inference.transport.deadline import within
from inference.transport.wire import Delta, Done


class Call(_QueueCall):
    def __init__(self) -> None:
        super().__init__("req-test", asyncio.Queue())
        self.aborted = False
        self.stall_timeout = 30.0

    async def abort(self) -> None:
        self.aborted = True


async def consume(call: Call, seen: list[object]) -> None:
    async with call:
        async for event in call.events():
            seen.append(event)


@pytest.mark.parametrize("steps", range(6))
async def test_a_cancel_that_meets_an_event_still_ends_the_stream_and_aborts_it(steps):
    call, seen = Call(), []
    reader = asyncio.create_task(consume(call, seen))
    for _ in range(3):
        await asyncio.sleep(0)
    call.queue.put_nowait(Delta(text="a"))
    for _ in range(steps):  # every interleaving of the event's arrival and the cancel
        await asyncio.sleep(0)
    reader.cancel()
    call.queue.put_nowait(Delta(text="b"))
    await asyncio.wait([reader], timeout=5)
    assert reader.cancelled(), f"the cancel was lost: the reader went on and saw {seen}"
    assert call.aborted
    assert len(seen) <= 2


async def test_within_times_out_and_passes_results_through():
    assert await within(asyncio.sleep(0, "done"), 1) == "done"
    assert await within(asyncio.sleep(0, "unbounded"), None) == "unbounded"
    with pytest.raises(TimeoutError):
        await within(asyncio.sleep(5), 0.01)


async def test_an_engine_stalled_after_its_first_event_is_a_504_and_aborted():
    call, seen = Call(), []
    call.stall_timeout = 0.05
    call.queue.put_nowait(Delta(text="a"))
    from hypnos_site.errors import EngineTimeout

    with pytest.raises(EngineTimeout):
        await consume(call, seen)
    assert call.aborted and [type(e).__name__ for e in seen] == ["Delta"]


async def test_the_wait_for_the_first_event_is_not_the_stall_limit():
    """The prompt's evaluation may take longer than request_timeout_secs (spec §4: it bounds the
    time to the headers; a stream's body runs as long as max_tokens takes)."""
    call, seen = Call(), []
    call.stall_timeout = 0.05

    async def engine() -> None:
        await asyncio.sleep(0.5)  # ten times the stall limit before the first token
        call.queue.put_nowait(Delta(text="a"))
        call.queue.put_nowait(Done())

    feeder = asyncio.create_task(engine())
    await within(consume(call, seen), 30)
    await feeder
    assert [type(e).__name__ for e in seen] == ["Delta", "Done"] and not call.aborted


async def test_the_events_end_at_done():
    call, seen = Call(), []
    call.queue.put_nowait(Delta(text="a"))
    call.queue.put_nowait(Done())
    await within(consume(call, seen), 5)
    assert [type(e).__name__ for e in seen] == ["Delta", "Done"] and not call.aborted
