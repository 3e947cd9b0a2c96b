"""The one renderer of an error, in each of the three shapes a route answers in (spec §4, §7.4):
a JSON envelope with the spec's status, an SSE error chunk then `[DONE]` (a stream whose headers
are out), or a realtime (WebSocket) error object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from django.http import JsonResponse, StreamingHttpResponse

from hypnos_site.errors import HypnosError
from logs.record import CallRecord

DONE = "data: [DONE]\n\n"


def error_fields(error: HypnosError) -> dict[str, Any]:
    """The envelope's inner object: message, type, param, code."""
    return error.body()["error"]  # type: ignore[no-any-return]


def json_error(error: HypnosError, record: CallRecord | None = None) -> JsonResponse:
    if record is not None:
        record.note_error(error.message, error.type)
    return error.response()


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(error: HypnosError, chunk: dict[str, Any], record: CallRecord | None = None) -> str:
    """`chunk` (the route's last chunk, its finish_reason "error") with the error at its top
    level, then [DONE]: a client must treat it as a failure although the status was 200."""
    if record is not None:
        record.note_error(error.message, error.type)
    return sse_data({**chunk, "error": error_fields(error)}) + DONE


def ws_error(error: HypnosError, record: CallRecord | None = None) -> dict[str, Any]:
    """The `error` object of a realtime event."""
    if record is not None:
        record.note_error(error.message, error.type)
    return {**error_fields(error), "code": error.code or error.type}


# -- the other APIs' dialects (Anthropic Messages, Ollama): the same errors, their shapes --------

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    507: "overloaded_error",
}


def anthropic_body(error: HypnosError) -> dict[str, Any]:
    """Anthropic's envelope: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _shaped(error: HypnosError, body: dict[str, Any], record: CallRecord | None) -> JsonResponse:
    """`body` as the error's response: its status and headers (Retry-After, WWW-Authenticate)."""
    if record is not None:
        record.note_error(error.message, error.type)
    response = JsonResponse(body, status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def anthropic_error(error: HypnosError, record: CallRecord | None = None) -> JsonResponse:
    return _shaped(error, anthropic_body(error), record)


def anthropic_sse_error(error: HypnosError, record: CallRecord | None = None) -> str:
    """The `error` event that ends an Anthropic stream whose headers are out."""
    if record is not None:
        record.note_error(error.message, error.type)
    return f"event: error\ndata: {json.dumps(anthropic_body(error), ensure_ascii=False)}\n\n"


def ollama_error(error: HypnosError, record: CallRecord | None = None) -> JsonResponse:
    """Ollama's envelope: `{"error": "<message>"}` with the status."""
    return _shaped(error, {"error": error.message}, record)


def ollama_ndjson_error(error: HypnosError, record: CallRecord | None = None) -> str:
    """The last NDJSON line of an Ollama stream whose headers are out."""
    if record is not None:
        record.note_error(error.message, error.type)
    return json.dumps({"error": error.message}, ensure_ascii=False) + "\n"


def sse_response(events: AsyncIterator[str]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
