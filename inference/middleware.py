"""Cross-cutting HTTP behaviour: request ids on every response and the body limit."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from inference import latency


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


class _Middleware:
    """Base for middleware that work on both the sync and the async path."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]]):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):  # type: ignore[no-untyped-def]
        early = self.before(request)
        if self.is_async:
            return self._acall(request, early)
        response = early or self.get_response(request)
        return self.after(request, response)  # type: ignore[arg-type]

    async def _acall(self, request: HttpRequest, early: HttpResponseBase | None) -> HttpResponseBase:
        response = early or await self.get_response(request)  # type: ignore[misc]
        return self.after(request, response)

    def before(self, request: HttpRequest) -> HttpResponseBase | None:
        return None

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        return response


class RequestIdMiddleware(_Middleware):
    """Every response carries `x-request-id: req-<32 hex>` (spec §1); the end-to-end time of
    every /v1 route is recorded, for a stream up to its last byte."""

    def before(self, request: HttpRequest) -> None:
        request.hypnos_request_id = new_request_id()  # type: ignore[attr-defined]
        request.hypnos_started = time.perf_counter()  # type: ignore[attr-defined]
        return None

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        response["x-request-id"] = request.hypnos_request_id  # type: ignore[attr-defined]
        match = getattr(request, "resolver_match", None)
        if match is not None and match.route and "^" not in match.route:
            route = "/" + match.route.removeprefix("api/")
            if isinstance(response, StreamingHttpResponse) and response.is_async:
                response.streaming_content = _timed(response.streaming_content, route, request)
            else:
                _observe(route, request)
        return response


def _observe(route: str, request: HttpRequest) -> None:
    """Record the route's end-to-end time and the request's part in a declared workflow."""
    started = request.hypnos_started  # type: ignore[attr-defined]
    ended = time.perf_counter()
    latency.routes.observe(route, (ended - started) * 1000)
    workflow = request.headers.get("x-hypnos-workflow")
    if workflow:
        last = request.headers.get("x-hypnos-workflow-end", "").lower() == "true"
        latency.workflows.observe(workflow, started, ended, last)


async def _timed(content: AsyncIterator[bytes], route: str, request: HttpRequest) -> AsyncIterator[bytes]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        _observe(route, request)


class BodyLimitMiddleware(_Middleware):
    """413 in plain text for a declared body above `limits.max_body_bytes` (spec §4)."""

    def before(self, request: HttpRequest) -> HttpResponseBase | None:
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        limit = settings.HYPNOS.limits.max_body_bytes
        if length > limit:
            return HttpResponse(
                f"Request body of {length} bytes exceeds limits.max_body_bytes ({limit})",
                status=413,
                content_type="text/plain; charset=utf-8",
            )
        return None
