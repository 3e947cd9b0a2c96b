"""SIGUSR1 writes what a process is waiting on to its log: every asyncio task, with the chain of
coroutines it is suspended in (what `py-spy dump` cannot see: a wedged request is a coroutine
waiting, not a thread), then every thread's stack (faulthandler, on stderr). Installed by the web
process (hypnos_site/serve.py) and the inference worker (`runinference`, the supervisor's child):

    kill -USR1 <pid>
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("hypnos.taskdump")
MAX_DEPTH = 64


def await_chain(coroutine: Any) -> list[str]:
    """Where `coroutine` (a task's) is suspended: one line per coroutine or async generator
    frame, outermost first."""
    lines: list[str] = []
    current = coroutine
    for _ in range(MAX_DEPTH):
        frame: FrameType | None = None
        for name in ("cr_frame", "ag_frame", "gi_frame"):
            frame = frame or getattr(current, name, None)
        if frame is None:
            break
        code = frame.f_code
        lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_qualname}")
        awaited = [getattr(current, name, None) for name in ("cr_await", "ag_await", "gi_yieldfrom")]
        current = next((each for each in awaited if each is not None), None)
    return lines


def dump_tasks(loop: asyncio.AbstractEventLoop) -> str:
    tasks = sorted(asyncio.all_tasks(loop), key=lambda task: task.get_name())
    parts = [f"{len(tasks)} asyncio task(s):"]
    for task in tasks:
        parts.append(f"task {task.get_name()} ({'done' if task.done() else 'pending'}):")
        parts.extend(await_chain(task.get_coro()))
        # The future its innermost await waits on (asyncio's own attribute; a repr, for people).
        waiter = getattr(task, "_fut_waiter", None)
        if waiter is not None:
            parts.append(f"  waiting on {waiter!r}"[:500])
    return "\n".join(parts)


def install(
    loop_of: Callable[[], asyncio.AbstractEventLoop], call_in_loop: Callable[[Callable[[], None]], object]
) -> None:
    """On SIGUSR1, log the tasks of the loop `loop_of()` returns (from inside it, via
    `call_in_loop`) and the stacks of all threads (on stderr)."""

    def dump() -> None:
        log.warning("SIGUSR1: %s", dump_tasks(loop_of()))

    def on_signal(number: int, frame: FrameType | None) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        call_in_loop(dump)

    signal.signal(signal.SIGUSR1, on_signal)
