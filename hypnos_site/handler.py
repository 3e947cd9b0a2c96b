"""Django's ASGI handler, with a request's thread-sensitive work on a pooled thread, and the
security middlewares' hooks on the event loop (hypnos_site/inline_middleware.py).

Django runs each request in a `ThreadSensitiveContext`: the first sync call of the request (the
request_started signal's database receivers, a sync middleware hook, a query) starts a thread
for it, and the context's exit starts another to join that one. Two thread starts a request were
~8% of the event loop's busy time under load (py-spy, warm max_tokens=1 chat calls). Here each
request borrows a single-thread executor from a pool and gives it back when it ends, so the
thread lives on. One request at a time uses an executor, as Django's own context guarantees."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler

from hypnos_site.inline_middleware import INLINE

# Executors kept for the next requests; more at once than this are shut down when they end.
POOL_SIZE = 32


class PooledASGIHandler(ASGIHandler):
    def __init__(self) -> None:
        super().__init__()
        self._idle: list[ThreadPoolExecutor] = []

    def load_middleware(self, is_async: bool = False) -> None:
        """Django's chain, with the inline subclasses where MIDDLEWARE names Django's security
        middlewares (the names stay in the setting for Django's deploy checks)."""
        named = settings.MIDDLEWARE
        settings.MIDDLEWARE = [INLINE.get(path, path) for path in named]
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = named

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        executor = self._idle.pop() if self._idle else ThreadPoolExecutor(1, thread_name_prefix="hypnos-request")
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            if len(self._idle) < POOL_SIZE:
                self._idle.append(executor)
            else:
                executor.shutdown(wait=False)

    def close(self) -> None:
        """Shut the kept executors' threads down (a handler made for a while, not the process's)."""
        idle, self._idle = self._idle, []
        for executor in idle:
            executor.shutdown(wait=False)


def get_asgi_application() -> PooledASGIHandler:
    """django.core.asgi.get_asgi_application with the pooled handler."""
    import django

    django.setup(set_prefix=False)
    return PooledASGIHandler()
