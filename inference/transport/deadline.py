"""Awaiting with a time limit, without losing a cancellation.

`asyncio.wait_for` on Python 3.11 returns the result when its awaitable completes at the moment
the caller is cancelled (cpython gh-86296, fixed in 3.12 by building wait_for on
`asyncio.timeout`): the cancellation is lost. A streaming response whose client left is
cancelled exactly that way (Django's ASGI handler cancels the response task), so a lost one kept
generating to the end, holding its slot and lease. `within` is the 3.12 behaviour on 3.11, and
makes no task per call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], secs: float | None) -> T:
    """`await awaitable`; TimeoutError after `secs` seconds (None: no limit)."""
    async with asyncio.timeout(secs):
        return await awaitable
