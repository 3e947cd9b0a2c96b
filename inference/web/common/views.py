"""The views no API surface owns: liveness and readiness, the JSON 404 of an unknown route and
the handlers Django calls for a 404 or an uncaught error."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.request import Request

from hypnos_site import __version__
from hypnos_site.errors import NotFound, database_reason, uncaught_response
from inference.transport.deadline import within
from inference.transport.runtime import get_client
from models_registry.api_view import APIView

STARTED_AT = time.time()


# GET /ready's database probe: past this it answers 503 (settings' connect_timeout, 3 s for
# PostgreSQL, bounds a connection attempt; this bounds a query on a connection that hangs).
DATABASE_PROBE_SECS = 5.0


# One thread of its own: its connection is kept between probes (a SELECT 1 on an open connection
# when healthy), and a probe stuck on a dead server holds this thread, not the loop's pool.
_database_probe = ThreadPoolExecutor(1, thread_name_prefix="hypnos-ready-db")


class UnknownRouteView(APIView):
    """Any other /v1 path: an OpenAI-shaped 404, never HTML."""

    def _not_found(self, request: Request, *args: object, **kwargs: object) -> None:
        raise NotFound(f"Unknown route {request.method} {request.path}.")

    get = post = put = patch = delete = _not_found


async def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse(
        {"status": "ok", "service": "hypnos", "version": __version__, "uptime_secs": int(time.time() - STARTED_AT)}
    )


async def ready(request: HttpRequest) -> JsonResponse:
    status = await get_client().status()
    if status is None:
        return JsonResponse({"ready": False, "reason": "no inference worker is answering"}, status=503)
    if not status["ready"]:
        return JsonResponse({"ready": False, "reason": "startup tier initialization in progress"}, status=503)
    problem = await database_problem()
    if problem is not None:
        return JsonResponse({"ready": False, "reason": f"the database is not answering: {problem}"}, status=503)
    return JsonResponse({"ready": True})


def _select_one() -> None:
    """SELECT 1 on this thread's connection. One that fails is closed, so the next probe
    connects afresh and the database's return is noticed by itself; a kept connection that
    fails (the server restarted since the last probe) is tried once more on a new one."""
    while True:
        reused = connection.connection is not None
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
            return
        except DatabaseError:
            connection.close()
            if not reused:
                raise


async def database_problem() -> str | None:
    """Why the database does not answer, in a few words, or None when it does."""
    probe = sync_to_async(_select_one, thread_sensitive=False, executor=_database_probe)
    try:
        await within(probe(), DATABASE_PROBE_SECS)
    except TimeoutError:
        return f"no answer within {DATABASE_PROBE_SECS:g} s"
    except DatabaseError as exc:
        return database_reason(exc)
    return None


def handler404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return NotFound(f"Unknown route {request.method} {request.path}.").response()


def handler500(request: HttpRequest) -> HttpResponse:
    # Django calls it inside the `except` of the exception no view handled.
    return uncaught_response(request, sys.exc_info()[1])
