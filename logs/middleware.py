"""Accounting of every inference call: the key's limits before the view, then, when the last
byte of the response is out, the token charge, the hypnos_* counters and the request log entry.

Usage, telemetry, finish reason and output come from the call's structured record
(logs.record.CallRecord, `request.hypnos_call`), which the serving code fills from the worker's
typed events; the response bytes are never parsed for them (an error response's envelope is
read for its message when the serving code did not note one, and at the trace level the text of
the payload is kept as it goes by).

It runs as Django middleware (outside DRF), so a 429 or 403 it answers never reaches the view,
and a streaming body is watched as it goes: the concurrency permit is given back and the stream
charged when the stream ends, however it ends. A call that gets a response was accounted for
before the client hears the end of it, so the next call of the same client sees its charge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, cast

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.http.request import RawPostDataException
from redis.exceptions import RedisError

from hypnos_site.errors import HypnosError, ModelNotAvailable, PermissionDenied, RateLimited, refusal
from hypnos_site.metrics import Observation, count_later, observation
from logs.capture import (
    CANCELLED,
    CapturedText,
    Redactor,
    entry_level,
    inference_route,
    input_text,
    is_kept,
    json_body,
    level_rank,
)
from logs.record import CallRecord
from logs.store import levels, store_later
from models_registry.authentication import ApiPrincipal, arequest_key_check
from models_registry.quotas import STREAM_LEASE_SECS, Permit, get_quotas

log = logging.getLogger(__name__)
# A JSON answer's bytes kept for the trace level's response_payload (CapturedText caps the text).
MAX_PAYLOAD_BYTES = 1 << 17
SCHEDULER_REFUSALS = ("model_busy", "deadline_unmeetable")
# The chat families, each from the engine timing of the same name.
CHAT_TIMINGS = (
    ("hypnos_chat_ttft_ms", "ttft_ms"),
    ("hypnos_chat_decode_tokens_per_s", "decode_tokens_per_s"),
    ("hypnos_chat_prefill_tokens_per_s", "prefill_tokens_per_s"),
)
DISCONNECTED = "the client disconnected before the response was complete"


class InferenceAccountingMiddleware:
    """Per-key limits, token charges, hypnos_* counters and the request log (spec §2, §15, §16)."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]):
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        route = inference_route(request.path) if request.method == "POST" else None
        if route is None:
            return await _count_http(request, await self.get_response(request))
        call = InferenceCallAccount(request, route)
        refusal = await call.admit()
        try:
            response = refusal or await self.get_response(request)
        except BaseException as exc:  # a cancelled task (the client left) or a bug: still account for it
            cancelled = isinstance(exc, asyncio.CancelledError)
            await _shielded(call.finish(499 if cancelled else 500, DISCONNECTED if cancelled else repr(exc)))
            raise
        if isinstance(response, StreamingHttpResponse):
            if response.is_async:
                keep_text = response.get("Content-Type", "").startswith("text/")
                response.streaming_content = call.watch(_async_content(response), response.status_code, keep_text)
                return response
        else:
            call.read_body(response)
        await _shielded(call.finish(response.status_code))
        return response


class InferenceCallAccount:
    """One inference call from its arrival to the last byte of its response."""

    def __init__(self, request: HttpRequest, route: str):
        self.request = request
        self.route = route
        self.request_id: str = getattr(request, "hypnos_request_id", "")
        self.started_at = datetime.now(UTC)
        self.started = time.perf_counter()
        self.body, self.raw_body = _request_body(request)
        self.model_name: str | None = None
        self.stream = False
        if isinstance(self.body, dict):
            self.model_name = self.body.get("model") if isinstance(self.body.get("model"), str) else None
            self.stream = self.body.get("stream") is True
        elif self.body is None and _is_form(request):
            self.model_name = request.POST.get("model") or None
        request.hypnos_model = self.model_name  # type: ignore[attr-defined]
        self.principal: ApiPrincipal | None = None
        self.permit: Permit | None = None
        self.refused_by_key = False
        self.record = CallRecord()
        request.hypnos_call = self.record  # type: ignore[attr-defined]
        # The response's text at the trace level (never parsed), and a stream's content type.
        self.payload = CapturedText()
        self.finished = False
        self.cancelled = False

    async def admit(self) -> HttpResponseBase | None:
        """The key's model restriction and limits: a 403 or 429 response, or None to go on."""
        check = await arequest_key_check(self.request)
        self.principal = check.principal
        principal = self.principal
        if principal is None:
            return None
        if self.model_name and not principal.may_use(self.model_name):
            self.refused_by_key = True
            return self.refuse(
                PermissionDenied(
                    f"The key {principal.label!r} may not use the model {self.model_name!r}; it may use "
                    f"{', '.join(principal.models)}.",
                    param="model",
                    code="model_not_allowed",
                )
            )
        if not principal.limited:
            return None
        try:
            self.permit = await get_quotas().admit(principal)
        except RateLimited as exc:
            self.refused_by_key = True
            return self.refuse(exc)
        except (RedisError, OSError) as exc:
            return self.refuse(ModelNotAvailable(f"The shared quota counters are unreachable: {exc}"))
        return None

    def refuse(self, error: HypnosError) -> HttpResponseBase:
        self.record.note_error(error.message, error.type)
        response = refusal(self.request, error)
        self.payload.add(response.content.decode())
        return response

    def read_body(self, response: HttpResponseBase) -> None:
        """An error response's message when the serving code noted none (the DRF handler
        rendered it), and the payload's text for the trace level."""
        content = getattr(response, "content", b"")
        is_text = response.get("Content-Type", "").startswith(("application/json", "text/"))
        if is_text:
            self.payload.add(content[:MAX_PAYLOAD_BYTES].decode("utf-8", errors="replace"))
        if response.status_code < 400 or self.record.error is not None:
            return
        envelope = json_body(content) if response.get("Content-Type", "").startswith("application/json") else None
        error = envelope.get("error") if isinstance(envelope, dict) else None
        if isinstance(error, dict):
            self.record.note_error(str(error.get("message") or error.get("type") or "error"), error.get("type"))
        else:
            self.record.note_error(content[:500].decode("utf-8", errors="replace").strip(), None)

    async def watch(self, content: AsyncIterator[bytes], status: int, keep_text: bool) -> AsyncIterator[bytes]:
        """The streaming body, unchanged; accounted when it ends. An event stream's text is
        kept for the trace level (audio is not)."""
        ended = False
        try:
            async for chunk in content:
                if keep_text and not self.payload.truncated:
                    self.payload.add(chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk)
                if self.permit is not None and self.permit.due_for_renewal():
                    await self._renew()
                yield chunk
            ended = True
        finally:
            if not ended:
                await _close(content)
            await _shielded(self.finish(status, None if ended else DISCONNECTED))

    async def _renew(self) -> None:
        assert self.permit is not None
        try:
            await get_quotas().renew(self.permit, STREAM_LEASE_SECS)
        except Exception:
            log.warning(
                "%s: renewing the concurrency permit of %s failed", self.request_id, self.permit.label, exc_info=True
            )

    async def finish(self, status: int, problem: str | None = None) -> None:
        """Charge, release, count and log, once; a failure here never reaches the client."""
        if self.finished:
            return
        self.finished = True
        if problem:
            self.record.note_error(problem, None)
        self.cancelled = problem == DISCONNECTED
        duration_ms = (time.perf_counter() - self.started) * 1000
        tokens = self.record.charged_tokens()
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("charging tokens", lambda: self._charge(tokens)),
            ("releasing the permit", self._release),
            ("counting", lambda: self._count(status, duration_ms, tokens)),
            ("logging", lambda: self._log(status, duration_ms)),
        ]
        for step, action in steps:
            try:
                await action()
            except Exception:
                log.error("%s: %s failed", self.request_id, step, exc_info=True)

    async def _count(self, status: int, duration_ms: float, tokens: int) -> None:
        count_later(self.observations(status, duration_ms, tokens), self.request_id)

    async def _charge(self, tokens: int) -> None:
        if self.principal is not None and tokens > 0:
            await get_quotas().charge(self.principal.label, tokens)

    async def _release(self) -> None:
        if self.permit is not None and self.permit.concurrent:
            await get_quotas().release(self.permit)

    def observations(self, status: int, duration_ms: float, tokens: int) -> list[Observation]:
        found = _http_observations(self.route, status, duration_ms)
        found.append(observation("hypnos_request_e2e_ms", duration_ms, route=self.route))
        found += record_observations(self.record, self.route, duration_ms, ok=status < 400 and not self.cancelled)
        if self.principal is not None:
            key = self.principal.label
            found.append(observation("hypnos_api_key_requests", 1, key=key))
            if self.refused_by_key:
                found.append(observation("hypnos_api_key_rejections", 1, key=key))
            if tokens:
                found.append(observation("hypnos_api_key_tokens", tokens, key=key))
        if self.record.error_type in SCHEDULER_REFUSALS:
            found.append(observation("hypnos_scheduler_admissions_rejected", 1))
        return found

    @property
    def model_id(self) -> str | None:
        """The pool's id the serving code resolved; before it did (a refusal of the key) the
        requested name as sent."""
        return self.record.model or self.model_name

    async def _log(self, status: int, duration_ms: float) -> None:
        threshold = await levels.get()
        level = entry_level(status, self.record.error, self.cancelled)
        if is_kept(level, threshold):
            store_later(self.entry_fields(status, duration_ms, level, threshold))

    def entry_fields(self, status: int, duration_ms: float, level: str, threshold: str) -> dict[str, Any]:
        """The columns of this call's RequestLogEntry; text only as far as `threshold` captures."""
        record = self.record
        tokens_in, tokens_out, cached = record.tokens_in, record.tokens_out, record.cached_tokens
        if self.cancelled and self.stream and tokens_out is None:
            # Cut before its end: what it generated is what it delivered.
            tokens_out = record.deltas
        telemetry = record.telemetry or {}
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "route": self.route,
            "method": self.request.method or "POST",
            "status": status,
            "key_label": self.principal.label if self.principal else None,
            "started_at": self.started_at,
            "duration_ms": round(duration_ms, 1),
            "model": self.model_id or "",
            "stream": self.stream,
            "tokens_in": tokens_in,
            "tokens_out": tokens_out,
            "cached_tokens": cached,
            "tokens_per_s": record.tokens_per_s(),
            "inference_ms": telemetry.get("inference_latency_ms"),
            "tier_switch_ms": telemetry.get("tier_switch_latency_ms"),
            "previous_tier": telemetry.get("previous_tier") or "",
            "error": record.error or "",
            "level": level,
            "finish_reason": CANCELLED if self.cancelled else record.finish_reason or "",
        }
        truncated = False
        if level_rank(threshold) >= level_rank("debug"):
            redact = Redactor(settings.HYPNOS.server.request_log_redact)
            texts = {"input": _captured(input_text(self.body)), "output": record.output}
            if level_rank(threshold) >= level_rank("trace"):
                texts["request_payload"] = _captured(self.raw_body)
                texts["response_payload"] = self.payload
            for name, text in texts.items():
                fields[name] = redact(text.text())
                truncated = truncated or text.truncated
        fields["truncated"] = truncated
        return fields


def record_observations(record: CallRecord, route: str, duration_ms: float, ok: bool) -> list[Observation]:
    """The families a call's record feeds (spec §16): chat speed and prefix-cache reuse, speech
    and transcription real-time factors, time to first audio, and a pipeline's whole time."""
    model = record.model
    if model is None or not ok:
        return []
    engine = record.engine()
    found: list[Observation] = []
    if record.work == "chat":
        if route == "/v1/chat/completions":
            found += [
                observation(name, engine[field], model=model)
                for name, field in CHAT_TIMINGS
                if isinstance(engine.get(field), (int, float))
            ]
        if record.tokens_in is not None:
            reused = record.cached_tokens or 0
            found.append(
                observation("hypnos_prefix_cache_hits" if reused else "hypnos_prefix_cache_misses", 1, model=model)
            )
            found.append(observation("hypnos_prefix_cache_tokens_reused", reused, model=model))
    elif record.work == "speech":
        if record.rtf is not None:
            found.append(observation("hypnos_tts_rtf", record.rtf, model=model))
        if record.ttfa_ms is not None:
            found.append(observation("hypnos_tts_ttfa_ms", record.ttfa_ms, model=model))
    elif record.work == "transcribe" and record.rtf is not None:
        found.append(observation("hypnos_stt_rtf", record.rtf, model=model))
    elif record.work == "image":
        # Job completion time: from the request's arrival to its images (spec §16).
        found.append(observation("hypnos_image_jct_s", duration_ms / 1000, model=model))
    elif record.work == "document" and isinstance(engine.get("pages"), int):
        found.append(observation("hypnos_document_pages", engine["pages"], model=model))
        if isinstance(engine.get("ms_per_page"), (int, float)):
            found.append(observation("hypnos_document_ms_per_page", engine["ms_per_page"], model=model))
    if record.stages:
        found.append(observation("hypnos_pipeline_e2e_ms", duration_ms, route=route))
    return found


def _captured(text: str | None) -> CapturedText:
    captured = CapturedText()
    captured.add(text or "")
    return captured


def _request_body(request: HttpRequest) -> tuple[Any, str | None]:
    """The JSON document of the request (None when it has none) and its text."""
    if not request.content_type or "json" not in request.content_type:
        return None, None
    try:
        raw = request.body
    except (RequestDataTooBig, RawPostDataException):
        return None, None
    return json_body(raw), raw.decode("utf-8", errors="replace")


def _is_form(request: HttpRequest) -> bool:
    return request.content_type in ("multipart/form-data", "application/x-www-form-urlencoded")


async def _close(content: AsyncIterator[bytes]) -> None:
    aclose = getattr(content, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.debug("closing a stream's source failed", exc_info=True)


async def _shielded(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` to its end even when the request's task is cancelled meanwhile (a client
    that disconnects must not leave a permit taken or a call unlogged)."""
    await asyncio.shield(asyncio.ensure_future(work))


# -- every other request: the HTTP families only ---------------------------------------------


def _http_observations(route: str, status: int, duration_ms: float) -> list[Observation]:
    return [
        observation("hypnos_http_requests", 1, route=route, **{"class": f"{status // 100}xx"}),
        observation("hypnos_http_request_latency_ms", duration_ms, route=route),
        observation("hypnos_http_request_latency_ms_max", duration_ms, route=route),
    ]


# What the label of every path the URL table does not name is (its catch-all routes, the
# only ones written as regular expressions, and a path nothing resolves).
UNMATCHED_ROUTE = "unmatched"


def _async_content(response: StreamingHttpResponse) -> AsyncIterator[bytes]:
    """The body of a response whose `is_async` is true: the async iterator Django gave it."""
    return cast(AsyncIterator[bytes], response.streaming_content)


def route_label(request: HttpRequest) -> str:
    """The route a request matched, as the URL table names it (`/v1/models/<path:model_id>`,
    Ollama's `/api/tags`, Lemonade's `/api/v1/load`), or UNMATCHED_ROUTE: the label of the
    route families, so an unknown path adds no label of its own."""
    match = getattr(request, "resolver_match", None)
    if match is None or not match.route or any(c in match.route for c in "^$*"):
        return UNMATCHED_ROUTE
    return "/" + match.route


async def _count_http(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    started = getattr(request, "hypnos_started", None) or time.perf_counter()

    async def record() -> None:
        elapsed = (time.perf_counter() - started) * 1000
        count_later(_http_observations(route_label(request), response.status_code, elapsed), request.path)

    if isinstance(response, StreamingHttpResponse) and response.is_async:
        response.streaming_content = _counted_stream(_async_content(response), record)
    else:
        await record()
    return response


async def _counted_stream(content: AsyncIterator[bytes], record: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        await record()
