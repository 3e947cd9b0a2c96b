"""The one choke point for errors: typed exceptions and their mapping to the spec's envelope.

Engines and the worker raise these; they travel between processes as inference.transport.wire's `Error`
event (`Error.of` / `Error.exception`); the DRF exception handler and inference/web/common/render.py
write them as `{"error": {"message", "type", "param", "code"}}` (compat.md) with the spec's status.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, resolve
from rest_framework import exceptions as drf

log = logging.getLogger(__name__)


class HypnosError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.type,
            }
        }

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


class InvalidRequest(HypnosError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class UnprocessableEntity(InvalidRequest):
    """A well-formed body whose value the route does not know (spec §6: an unknown moe-offload
    mode is 422)."""

    status = 422


class UnsupportedMediaType(InvalidRequest):
    """A body in a media type the route does not read (text/plain, a form where JSON is due)."""

    status = 415
    code = "unsupported_media_type"


# The code of a 400 for an upload above a route's own limit (limits.max_image_bytes,
# max_document_bytes; spec §1: 400, unlike the 413 of max_body_bytes at the body-limit layer).
TOO_LARGE = "payload_too_large"


class AuthenticationError(HypnosError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": 'Bearer realm="hypnos"'}


class PermissionDenied(HypnosError):
    status = 403
    type = "permission_denied"


class NotFound(HypnosError):
    status = 404
    type = "not_found"


class ModelNotFound(HypnosError):
    status = 404
    type = "model_not_found"


class ModelDisabled(HypnosError):
    status = 404
    type = "model_disabled"


class MethodNotAllowed(HypnosError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class ModelBusy(HypnosError):
    status = 429
    type = "model_busy"


class RateLimited(HypnosError):
    """A per-key limit refused the call (spec §2): `code` names the limit, Retry-After says
    when the same call can pass."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, retry_after_secs: int = 1):
        super().__init__(message, param=param, code=code)
        self.retry_after_secs = max(int(retry_after_secs), 1)
        self.headers = {"Retry-After": str(self.retry_after_secs)}


class Cancelled(HypnosError):
    status = 499
    type = "cancelled"


class ModelNotAvailable(HypnosError):
    status = 503
    type = "model_not_available"
    headers = {"Retry-After": "5"}


class JobLost(ModelNotAvailable):
    """A long job that stopped reporting (its Celery worker died) or that no worker took."""


class DatabaseUnavailable(ModelNotAvailable):
    """The database did not answer (PostgreSQL down or unreachable): an API-key lookup, the
    request log, the pool overlay. 503 with the type the spec's clients already retry on
    (model_not_available, as when the shared Redis is gone) and its own code; GET /ready says
    when the database answers again."""

    code = "database_unavailable"


# What Django raises when the database cannot be reached or the connection broke (not the
# errors of a bad query: those stay 500s).
DATABASE_ERRORS = (OperationalError, InterfaceError)


class DeadlineUnmeetable(HypnosError):
    status = 503
    type = "deadline_unmeetable"
    headers = {"Retry-After": "1"}


class EngineTimeout(HypnosError):
    status = 504
    type = "timeout"


class InsufficientMemory(HypnosError):
    status = 507
    type = "insufficient_vram_or_ram"


class ProcessMemoryCap(HypnosError):
    status = 507
    type = "process_memory_cap"


class DeviceOutOfMemory(HypnosError):
    status = 507
    type = "device_out_of_memory"


class ServerError(HypnosError):
    status = 500
    type = "server_error"


class RequestTimeout(HypnosError):
    """limits.request_timeout_secs passed before the answer was complete, as an error object
    (Ollama's clients read one, not the plain-text 408 of /v1)."""

    status = 408
    type = "timeout"


class InsufficientStorage(HypnosError):
    """Not enough disk for a download (a pull's files beside what the disk holds)."""

    status = 507
    type = "insufficient_storage"


class PullFailed(HypnosError):
    """A download that failed (refused, missing, interrupted, not the size or hash listed)."""

    status = 500
    type = "pull_failed"


STILL_STAGING = "Hypnos is still pre-staging its startup models; retry shortly (GET /ready reports when it is done)"


def database_reason(exc: BaseException) -> str:
    """The driver's message in one short line (psycopg's spans lines: the host, then why)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = "; ".join(lines) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def database_unavailable(exc: BaseException, where: object = None) -> DatabaseUnavailable:
    """The 503 a database error stands for; one warning line, no traceback (it is an outage,
    not a bug)."""
    reason = database_reason(exc)
    log.warning("the database is not answering (%s): %s", where, reason)
    return DatabaseUnavailable(
        f"The database is not answering ({reason}); retry shortly (GET /ready reports when it is back)."
    )


def _from_drf(exc: drf.APIException) -> HypnosError:
    if isinstance(exc, drf.ParseError):
        return InvalidRequest(f"We could not parse the body of your request: {exc.detail}")
    if isinstance(exc, (drf.NotAuthenticated, drf.AuthenticationFailed)):
        return AuthenticationError(str(exc.detail))
    if isinstance(exc, drf.PermissionDenied):
        return PermissionDenied(str(exc.detail))
    if isinstance(exc, drf.MethodNotAllowed):
        return MethodNotAllowed(str(exc.detail))
    if isinstance(exc, drf.UnsupportedMediaType):
        return UnsupportedMediaType(str(exc.detail))
    if isinstance(exc, drf.NotFound):
        return NotFound(str(exc.detail))
    err = InvalidRequest(str(exc.detail))
    err.status = exc.status_code
    return err


def refusal(request: HttpRequest, error: HypnosError) -> HttpResponse:
    """A middleware's refusal, before any view runs, in the shape of the route the request
    resolves to when its view (a class view, or a function view) names one (`error_response`:
    the Ollama and Anthropic routes answer in their APIs' shapes), else in the envelope."""
    try:
        match = resolve(request.path_info)
    except Resolver404:
        return error.response()
    render = getattr(getattr(match.func, "cls", match.func), "error_response", None)
    return render(error) if render is not None else error.response()


def as_hypnos_error(exc: Exception, view: object = None) -> HypnosError:
    """The typed error any exception of a view stands for (a 500 for one that is not ours); the
    routes of the other APIs (Ollama, Anthropic) render it in their own shape."""
    if isinstance(exc, Http404):
        # DRF's own (an unknown ?format= has no renderer) and get_object_or_404's.
        exc = NotFound(str(exc) or "Not found.")
    if isinstance(exc, drf.APIException):
        exc = _from_drf(exc)
    if isinstance(exc, DATABASE_ERRORS):
        exc = database_unavailable(exc, type(view).__name__ if view is not None else None)
    if not isinstance(exc, HypnosError):
        log.exception("unhandled error in %s", view)
        exc = ServerError(f"internal error: {type(exc).__name__}")
    return exc


def exception_handler(exc: Exception, context: dict[str, Any]) -> JsonResponse | None:
    """DRF's EXCEPTION_HANDLER: every error of a /v1 view leaves through here."""
    return as_hypnos_error(exc, context.get("view")).response()


def uncaught_response(request: HttpRequest, exc: BaseException | None) -> HttpResponse:
    """Django's handler500: what an exception no view handled answers, one raised by a
    middleware (the accounting middleware's key lookup) or a plain Django view. A database
    error is the 503 above, in the route's shape (`refusal`), and marked as logged so Django
    does not log it again with its traceback; anything else is the 500 it always was."""
    if isinstance(exc, DATABASE_ERRORS):
        response = refusal(request, database_unavailable(exc, request.path))
        response._has_been_logged = True  # type: ignore[attr-defined]  # django.utils.log.log_response
        return response
    return ServerError("internal error").response()


class OllamaModelNotFound(HypnosError):
    """Ollama's 404 for a name it cannot resolve, in its words."""

    status = 404
    type = "model_not_found"

    def __init__(self, name: str):
        super().__init__(f"model '{name}' not found", param="model")
