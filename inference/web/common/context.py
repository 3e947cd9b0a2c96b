"""What a serving function needs to know about the HTTP request beyond its body."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest
from inference.transport.client import InferenceCall, InferenceClient
from inference.transport.wire import EngineRequest, Started, Work
from inference.web.common.pool import pool
from logs.record import CallRecord


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    # x-hypnos-deadline-ms: the longest the request may wait before it starts.
    deadline_ms: float | None = None
    # x-hypnos-next-model: the model the client will call next, loaded meanwhile.
    next_model: str | None = None
    # x-hypnos-priority: background: a slot only while no interactive request waits for one.
    background: bool = False
    # The call's structured record (logs.middleware hangs it on the request; a call made
    # without one, a pipeline stage or a realtime turn, gets its own).
    record: CallRecord = field(default_factory=CallRecord, compare=False)

    @classmethod
    def of(cls, request: HttpRequest) -> RequestContext:
        deadline = request.headers.get("x-hypnos-deadline-ms")
        if deadline is not None:
            try:
                deadline_ms: float | None = float(deadline)
            except ValueError:
                deadline_ms = -1.0
            if deadline_ms is not None and not 0 <= deadline_ms < float("inf"):
                raise InvalidRequest(
                    "x-hypnos-deadline-ms must be a number of milliseconds, not negative", param="x-hypnos-deadline-ms"
                )
        else:
            deadline_ms = None
        priority = request.headers.get("x-hypnos-priority", "interactive")
        if priority not in ("interactive", "background"):
            raise InvalidRequest("x-hypnos-priority must be interactive or background", param="x-hypnos-priority")
        record = getattr(request, "hypnos_call", None) or CallRecord()
        return cls(
            request.hypnos_request_id,  # type: ignore[attr-defined]
            deadline_ms,
            request.headers.get("x-hypnos-next-model") or None,
            priority == "background",
            record,
        )


async def resolve_model(client: InferenceClient, name: str, ctx: RequestContext) -> ModelConfig:
    """The pool's model `name` (an id or an alias) stands for, once per request; 404
    model_not_found. Noted in the call's record."""
    await pool.ensure(client, name)
    model = pool.find(name)
    ctx.record.model = model.id
    return model


async def start_call(
    client: InferenceClient, model: ModelConfig, work: Work, ctx: RequestContext
) -> tuple[InferenceCall, Started]:
    """Submit the work with the context's deadline and next model; the call fills the record."""
    ctx.record.work = work.kind
    request = EngineRequest(
        request_id=ctx.request_id,
        model=model.id,
        work=work,
        deadline_ms=ctx.deadline_ms,
        next_model=ctx.next_model,
        background=ctx.background,
    )
    return await client.start(request, ctx.record)


def with_wait_estimate(response: HttpResponseBase, call: InferenceCall) -> HttpResponseBase:
    """x-hypnos-estimated-wait-ms on an admitted request's response, when the worker made one."""
    if call.estimated_wait_ms is not None:
        response["x-hypnos-estimated-wait-ms"] = f"{call.estimated_wait_ms:.0f}"
    return response


def check_prompt_chars(chars: int, param: str) -> None:
    """400 naming `param` when the request's text is longer than limits.max_prompt_chars."""
    limit = settings.HYPNOS.limits.max_prompt_chars
    if chars > limit:
        raise InvalidRequest(
            f"The input holds {chars} characters, above limits.max_prompt_chars ({limit}).", param=param
        )


def request_timed_out(timeout: float) -> HttpResponse:
    """408 in plain text, as the timeout layer of the spec answers (§4)."""
    return HttpResponse(
        f"request_timeout_secs ({timeout:g} s) elapsed", status=408, content_type="text/plain; charset=utf-8"
    )
