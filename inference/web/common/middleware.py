"""Cross-cutting HTTP behaviour: request ids on every response, the body limit, and the checks
that keep web pages from using the server (Host, Origin, content type)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from channels.security.websocket import OriginValidator, WebsocketDenier
from django.conf import settings
from django.core.exceptions import DisallowedHost, SuspiciousOperation
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.http.multipartparser import MultiPartParserError
from django.http.request import split_domain_port, validate_host
from django.urls import Resolver404, resolve
from rest_framework.utils.mediatypes import media_type_matches

from hypnos_site.errors import InvalidRequest, PermissionDenied, UnsupportedMediaType, refusal
from inference.web.common import latency
from inference.web.common.parsers import multipart_problem, reads_json
from inference.web.common.views import UnknownRouteView
from logs.middleware import UNMATCHED_ROUTE, route_label


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
    """Every response carries `x-request-id: req-<32 hex>` (spec §1), and the client's own id
    (`X-Client-Request-Id`, or an `X-Request-Id` it sent) back as `x-client-request-id`; the
    end-to-end time of every route is recorded and one line logged on `hypnos.access`, for a
    stream when its last byte is out."""

    def before(self, request: HttpRequest) -> None:
        request.hypnos_request_id = new_request_id()  # type: ignore[attr-defined]
        request.hypnos_started = time.perf_counter()  # type: ignore[attr-defined]
        return None

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        response["x-request-id"] = request.hypnos_request_id  # type: ignore[attr-defined]
        client_id = client_request_id(request)
        if client_id:
            response["x-client-request-id"] = client_id
        label = route_label(request)
        route = None if label == UNMATCHED_ROUTE else label
        if isinstance(response, StreamingHttpResponse) and response.is_async:
            # is_async: the content is the async iterator Django gave it.
            content = cast(AsyncIterator[bytes], response.streaming_content)
            response.streaming_content = _timed(content, route, request, response.status_code, client_id)
        else:
            _observe(route, request, response.status_code, client_id)
        return response


def client_request_id(request: HttpRequest) -> str | None:
    """The id the client gave its request, when it is printable ASCII of at most 128
    characters (anything else is not echoed or logged)."""
    given = request.headers.get("x-client-request-id") or request.headers.get("x-request-id")
    if given and len(given) <= MAX_CLIENT_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return None


def _observe(route: str | None, request: HttpRequest, status: int, client_id: str | None) -> None:
    """Record the route's end-to-end time and the request's part in a declared workflow, and
    log its line."""
    ms = (time.perf_counter() - request.hypnos_started) * 1000  # type: ignore[attr-defined]
    if route is not None:
        workflow = request.headers.get("x-hypnos-workflow")
        if workflow:
            last = request.headers.get("x-hypnos-workflow-end", "").lower() == "true"
            ended = time.time()
            latency.observe_workflow(workflow, ended - ms / 1000, ended, last)
    _access_line(request, status, ms, client_id)


def _access_line(request: HttpRequest, status: int, ms: float, client_id: str | None) -> None:
    """One line per request: its id, method and path, model, status, duration, tokens (from the
    call's record, on inference routes) and the client's id; JSON fields with log_format json."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    record = getattr(request, "hypnos_call", None)
    fields: dict[str, object] = {
        "request_id": request.hypnos_request_id,  # type: ignore[attr-defined]
        "method": request.method,
        "path": request.path,
        "status": status,
        "duration_ms": round(ms, 1),
    }
    if record is not None:
        fields["model"] = getattr(request, "hypnos_model", None)
        fields["prompt_tokens"], fields["completion_tokens"] = record.tokens_in, record.tokens_out
    if client_id:
        fields["client_request_id"] = client_id
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("method", "path"))
    access_log.info("%s %s %s", request.method, request.path, text, extra=fields)


async def _timed(
    content: AsyncIterator[bytes], route: str | None, request: HttpRequest, status: int, client_id: str | None
) -> AsyncIterator[bytes]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        _observe(route, request, status, client_id)


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


STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
access_log = logging.getLogger("hypnos.access")
MAX_CLIENT_ID_CHARS = 128


def origin_allowed(origin: str, host: str) -> bool:
    """An Origin header the server takes state-changing calls from: a CORS origin of settings
    (loopback, `server.allowed_origins`) or the server's own origin (`host`: an allowed Host)."""
    if any(re.match(pattern, origin) for pattern in settings.CORS_ALLOWED_ORIGIN_REGEXES):
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


class BrowserGuardMiddleware(_Middleware):
    """What keeps a web page from using a server on this machine, keys or not (spec §1):

    - the Host header must be one the server answers to (settings.ALLOWED_HOSTS: loopback names,
      server.host, server.allowed_hosts), else 400: a DNS-rebinding page reaches 127.0.0.1 under
      its own name and would otherwise be same-origin with the API;
    - a state-changing call whose Origin header is present must come from an allowed origin,
      else 403 permission_denied: a cross-site form or fetch() needs no preflight;
    - a state-changing call to a DRF route that reads no JSON (multipart only) must send a
      media type one of its parsers reads, else 415. A route that reads JSON reads a body of
      any other label as JSON (`_label_json`; what does not parse is a 400): a page's
      cross-site text/plain or url-encoded post carries an Origin, refused above.

    Clients that are not browsers send no Origin header: nothing changes for them.

    Each refusal is in the route's own shape (Ollama's, Anthropic's: hypnos_site.errors.refusal).
    """

    def before(self, request: HttpRequest) -> HttpResponseBase | None:
        try:
            host = request.get_host()
        except DisallowedHost:
            raw = request.META.get("HTTP_HOST", "")[:200]
            return refusal(
                request,
                InvalidRequest(
                    f"The Host header {raw!r} is not a name this server answers to; "
                    "an operator adds it to server.allowed_hosts.",
                    code="disallowed_host",
                ),
            )
        if request.method not in STATE_CHANGING:
            return None
        origin = request.headers.get("origin")
        if origin is not None and not origin_allowed(origin, host):
            return refusal(
                request,
                PermissionDenied(
                    f"Calls from the web origin {origin[:200]!r} may not change anything here; "
                    "an operator adds it to server.allowed_origins.",
                    code="origin_not_allowed",
                ),
            )
        return _media_type_refusal(request)


# What a page may send cross-site without a preflight (the CORS-safelisted request types).
SIMPLE_MEDIA_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def _media_type_refusal(request: HttpRequest) -> HttpResponseBase | None:
    try:
        match = resolve(request.path_info)
    except Resolver404:
        return None
    view_class = getattr(match.func, "cls", None)
    # Not a DRF route (the admin has Django's CSRF protection), or the catch-all 404 of /v1.
    if view_class is None or issubclass(view_class, UnknownRouteView):
        return None
    parsers = view_class.parser_classes
    media_type = request.META.get("CONTENT_TYPE", "").strip()
    accepted = [parser.media_type for parser in parsers]
    if media_type and any(media_type_matches(accepted_type, media_type) for accepted_type in accepted):
        return _multipart_refusal(request)
    if reads_json(parsers):
        if _has_body(request):
            _label_json(request)
        return None
    # A body the route cannot read, or a preflight-free type even without a body.
    if not _has_body(request) and not (request.content_type or "").lower().startswith(SIMPLE_MEDIA_TYPES):
        return None
    return refusal(
        request,
        UnsupportedMediaType(
            f"Content-Type {media_type[:100]!r} is not accepted here; send {' or '.join(accepted)}.",
            param="Content-Type",
        ),
    )


def _label_json(request: HttpRequest) -> None:
    """Take a body a JSON route got under another label (none, curl's url-encoded default,
    text/plain, multipart on a route that reads no multipart) for JSON, as Ollama does: the
    request log and DRF then read it as the JSON it is, and what does not parse is a 400. Never
    as a form: reading one would use up the body before the view."""
    request.META["CONTENT_TYPE"] = "application/json"
    request.content_type, request.content_params = "application/json", {}


def _multipart_refusal(request: HttpRequest) -> HttpResponseBase | None:
    """A multipart body Django cannot split (no boundary, a cut part, more fields or files than
    DATA_UPLOAD_MAX_NUMBER_FIELDS / _FILES) is a 400 in the envelope here. Read later, by the
    request log's middleware or by DRF, it was Django's bare HTML 400 (or a 500 through DRF).
    The parts read here are what the view gets (request.POST and FILES are kept)."""
    if request.content_type != "multipart/form-data":
        return None
    try:
        request.POST  # noqa: B018 (parses and keeps the parts)
    except (MultiPartParserError, SuspiciousOperation) as exc:
        problem = InvalidRequest(f"The multipart/form-data body could not be read: {multipart_problem(exc)}")
        return refusal(request, problem)
    return None


def _has_body(request: HttpRequest) -> bool:
    length = request.META.get("CONTENT_LENGTH") or "0"
    return length != "0" or "HTTP_TRANSFER_ENCODING" in request.META


class RealtimeOriginValidator(OriginValidator):
    """WS /v1/realtime with the HTTP routes' rules: a handshake whose Host is not served here,
    or whose Origin (browsers always send one) is not allowed, is refused (403 on the
    handshake). Clients that are not browsers send no Origin and pass."""

    def __init__(self, application: Any):
        super().__init__(application, allowed_origins=[])

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        if self.handshake_allowed(_header(scope, b"host") or "", _header(scope, b"origin")):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)

    def handshake_allowed(self, host: str, origin: str | None) -> bool:
        domain, _ = split_domain_port(host)
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return False
        return origin is None or origin_allowed(origin, host)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin1")
    return None
