"""Where state shared by the web processes lives: Redis in the distributed deployment, this
process's memory in the embedded one.

Quota counters, the hypnos_* metric counters and the request log's level all choose their backend
here, so one setting (`server.deployment`) decides for every one of them. Redis keys start with
`server.channel_prefix`, so separate servers on one Redis never share counters.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from django.conf import settings
from redis.asyncio import Redis
from redis.commands.core import AsyncScript


def is_distributed() -> bool:
    return settings.HYPNOS.server.deployment == "distributed"


def state_key(*parts: str) -> str:
    """A Redis key under this server's prefix: `<channel_prefix>:<part>:<part>...`."""
    return ":".join((settings.HYPNOS.server.channel_prefix, *parts))


class LoopRedis:
    """One Redis client per event loop. A redis.asyncio connection belongs to the loop that
    opened it, and a process may run more than one loop (daphne's, asgiref's for sync code)."""

    def __init__(self, url: str):
        self.url = url
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Redis] = weakref.WeakKeyDictionary()
        self._scripts: dict[str, AsyncScript] = {}

    def client(self) -> Redis:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = Redis.from_url(self.url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)
            self._clients[loop] = client
        return client

    async def run_script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        """Run a Lua script atomically (EVALSHA, loading it the first time)."""
        client = self.client()
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = client.register_script(source)
        return await script(keys=keys, args=args, client=client)


_shared: dict[str, LoopRedis] = {}


def shared_redis(url: str | None = None) -> LoopRedis:
    """The process's Redis for `url` (default `server.redis_url`)."""
    url = url or settings.HYPNOS.server.redis_url
    if url not in _shared:
        _shared[url] = LoopRedis(url)
    return _shared[url]
