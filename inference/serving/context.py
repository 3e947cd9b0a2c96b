"""What a serving function needs to know about the HTTP request beyond its body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from inference.client import Event, InferenceCall, InferenceClient
from hypnos_site.errors import InvalidRequest


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    # x-hypnos-deadline-ms: the longest the request may wait before it starts.
    deadline_ms: float | None = None
    # x-hypnos-next-model: the model the client will call next, loaded meanwhile.
    next_model: str | None = None

    @classmethod
    def of(cls, request: HttpRequest) -> RequestContext:
        deadline = request.headers.get("x-hypnos-deadline-ms")
        if deadline is not None:
            try:
                deadline_ms: float | None = float(deadline)
            except ValueError:
                deadline_ms = -1.0
            if deadline_ms is not None and not 0 <= deadline_ms < float("inf"):
                raise InvalidRequest("x-hypnos-deadline-ms must be a number of milliseconds, not negative",
                                     param="x-hypnos-deadline-ms")
        else:
            deadline_ms = None
        return cls(request.hypnos_request_id, deadline_ms, request.headers.get("x-hypnos-next-model") or None)  # type: ignore[attr-defined]


async def start_call(client: InferenceClient, model: str, payload: dict[str, Any],
                     ctx: RequestContext) -> tuple[InferenceCall, Event]:
    """Submit a text-generation request with the context's deadline and next model."""
    return await client.start("chat", model, payload, ctx.request_id, ctx.deadline_ms, ctx.next_model)


def with_wait_estimate(response: HttpResponseBase, call: InferenceCall) -> HttpResponseBase:
    """x-hypnos-estimated-wait-ms on an admitted request's response, when the worker made one."""
    if call.estimated_wait_ms is not None:
        response["x-hypnos-estimated-wait-ms"] = f"{call.estimated_wait_ms:.0f}"
    return response
