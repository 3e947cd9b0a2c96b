"""SIGUSR1's task dump (hypnos_site/taskdump.py): a request waiting is a coroutine chain that a
thread dump cannot see; the dump names every coroutine of it, down to the future it waits on."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from hypnos_site import taskdump


async def innermost(future: asyncio.Future[None]) -> None:
    await future


async def middle(future: asyncio.Future[None]) -> None:
    await innermost(future)


async def test_the_dump_names_each_coroutine_a_task_waits_in_and_its_future():
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(middle(future), name="stuck-request")
    await asyncio.sleep(0)
    text = taskdump.dump_tasks(asyncio.get_running_loop())
    future.set_result(None)
    await task
    lines = text.splitlines()
    start = lines.index("task stuck-request (pending):")
    assert "in middle" in lines[start + 1] and "in innermost" in lines[start + 2]
    assert "waiting on <Future pending" in lines[start + 3]


async def test_sigusr1_logs_the_tasks_from_inside_the_loop(caplog):
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        taskdump.install(lambda: loop, loop.call_soon_threadsafe)
        with caplog.at_level(logging.WARNING, logger="hypnos.taskdump"):
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if "SIGUSR1:" in caplog.text:
                    break
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert "asyncio task(s):" in caplog.text
    assert "test_sigusr1_logs_the_tasks_from_inside_the_loop" in caplog.text
