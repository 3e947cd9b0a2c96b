"""/static/: the admin's files and the vendored pages' assets, served by the web process itself in
both deployments (daphne has no static file server, and Django's own serves only under DEBUG).

WhiteNoise finds the files and answers with their headers (content type, ETag, Last-Modified,
304s, ranges); this subclass runs on the event loop, since WhiteNoise's
middleware is sync only and every API call would otherwise hop to a thread to pass it. The files
come from the finders (the apps' `static/` and STATICFILES_DIRS) scanned once at start, so a
fresh checkout needs no collectstatic; a collected STATIC_ROOT is served too when there is one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, BinaryIO

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from whitenoise.middleware import WhiteNoiseMiddleware

CHUNK_BYTES = 64 << 10

Handler = Callable[[HttpRequest], Awaitable[HttpResponseBase]]


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Handler) -> None:
        super().__init__(get_response, settings=_WithoutScriptPrefix())
        markcoroutinefunction(self)

    def add_files(self, root: str, prefix: str | None = None) -> None:
        # STATIC_ROOT exists only after a collectstatic; without one the finders serve everything.
        if os.path.isdir(root):
            super().add_files(root, prefix)

    def immutable_file_test(self, path: str, url: str) -> bool:
        """No file is cached for ever: the storage puts no hash in the names. (WhiteNoise's own test
        asks the storage for URLs while starting, outside any request, which would fix its base
        URL without the script prefix a reverse proxy mounts the server under.)"""
        return False

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:  # type: ignore[override]
        # Under DEBUG (WhiteNoise's autorefresh) the files are looked up on disk at each request.
        found = self.find_file(request.path_info) if self.autorefresh else self.files.get(request.path_info)
        if found is None:
            return await self.get_response(request)  # type: ignore[no-any-return]
        answer = found.get_response(request.method, request.META)
        response = StreamingHttpResponse(_chunks(answer.file), status=int(answer.status))
        del response["Content-Type"]
        for name, value in answer.headers:
            response[name] = value
        return response


class _WithoutScriptPrefix:
    """Django's settings as WhiteNoise reads them while starting, STATIC_URL as written. Django
    puts the script prefix in front of a relative STATIC_URL at its first read and keeps that
    value; a read here, outside any request, would keep none, and the pages of a server behind a
    reverse proxy's prefix (daphne's --root-path) would link their assets without it. The files
    are looked up by path_info, which never has the prefix."""

    def __getattr__(self, name: str) -> Any:
        if name != "STATIC_URL":
            return getattr(settings, name)
        written: str = settings._wrapped.STATIC_URL
        return written if written.startswith(("/", "http://", "https://")) else "/" + written


async def _chunks(file: BinaryIO | None) -> AsyncIterator[bytes]:
    """The file's bytes read off the event loop (none for a HEAD or a 304)."""
    if file is None:
        return
    with file:
        while chunk := await asyncio.to_thread(file.read, CHUNK_BYTES):
            yield chunk
