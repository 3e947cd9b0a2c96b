"""Accounting of every inference call: the key's limits before the view, then, when the last
byte of the response is out, the token charge, the hypnos_* counters and the request log entry.

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
from typing import Any

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.http.request import RawPostDataException
from redis.exceptions import RedisError

from hypnos_site.metrics import Observation, get_counters, observation
from hypnos_site.errors import HypnosError, ModelNotAvailable, PermissionDenied, RateLimited
from logs.capture import (
    CANCELLED,
    CapturedText,
    Redactor,
    ResponseReading,
    entry_level,
    inference_route,
    input_text,
    is_kept,
    json_body,
    level_rank,
)
from logs.store import levels, store_entry
from models_registry.authentication import ApiPrincipal, request_key_check
from models_registry.quotas import STREAM_LEASE_SECS, Permit, get_quotas

log = logging.getLogger(__name__)
SCHEDULER_REFUSALS = ("model_busy", "deadline_unmeetable")
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
                response.streaming_content = call.watch(response.streaming_content, response.status_code)
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
        self.principal: ApiPrincipal | None = None
        self.permit: Permit | None = None
        self.refused_by_key = False
        self.reading = ResponseReading()
        self.finished = False
        self.cancelled = False

    async def admit(self) -> HttpResponseBase | None:
        """The key's model restriction and limits: a 403 or 429 response, or None to go on."""
        check = await sync_to_async(request_key_check)(self.request)
        self.principal = check.principal
        principal = self.principal
        if principal is None:
            return None
        if self.model_name and not principal.may_use(self.model_name):
            self.refused_by_key = True
            return self.refuse(PermissionDenied(
                f"The key {principal.label!r} may not use the model {self.model_name!r}; it may use "
                f"{', '.join(principal.models)}.", param="model", code="model_not_allowed"))
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
        response = error.response()
        self.reading.read_json(response.content)
        return response

    def read_body(self, response: HttpResponseBase) -> None:
        content = getattr(response, "content", b"")
        if response.get("Content-Type", "").startswith("application/json"):
            self.reading.read_json(content)
        elif response.status_code >= 400 and self.reading.error is None:
            self.reading.error = content[:500].decode("utf-8", errors="replace").strip()

    async def watch(self, content: AsyncIterator[bytes], status: int) -> AsyncIterator[bytes]:
        """The streaming body, unchanged, read on its way out; accounted when it ends."""
        ended = False
        try:
            async for chunk in content:
                self.reading.feed_sse(chunk)
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
            log.warning("%s: renewing the concurrency permit of %s failed", self.request_id, self.permit.label,
                        exc_info=True)

    async def finish(self, status: int, problem: str | None = None) -> None:
        """Charge, release, count and log, once; a failure here never reaches the client."""
        if self.finished:
            return
        self.finished = True
        if problem and self.reading.error is None:
            self.reading.error = problem
        self.cancelled = problem == DISCONNECTED
        duration_ms = (time.perf_counter() - self.started) * 1000
        tokens = self.reading.charged_tokens()
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("charging tokens", lambda: self._charge(tokens)),
            ("releasing the permit", self._release),
            ("counting", lambda: get_counters().record(self.observations(status, duration_ms, tokens))),
            ("logging", lambda: self._log(status, duration_ms)),
        ]
        for step, action in steps:
            try:
                await action()
            except Exception:
                log.error("%s: %s failed", self.request_id, step, exc_info=True)

    async def _charge(self, tokens: int) -> None:
        if self.principal is not None and tokens > 0:
            await get_quotas().charge(self.principal.label, tokens)

    async def _release(self) -> None:
        if self.permit is not None and self.permit.concurrent:
            await get_quotas().release(self.permit)

    def observations(self, status: int, duration_ms: float, tokens: int) -> list[Observation]:
        found = _http_observations(self.route, status, duration_ms)
        if self.principal is not None:
            key = self.principal.label
            found.append(observation("hypnos_api_key_requests", 1, key=key))
            if self.refused_by_key:
                found.append(observation("hypnos_api_key_rejections", 1, key=key))
            if tokens:
                found.append(observation("hypnos_api_key_tokens", tokens, key=key))
        if self.reading.error_type in SCHEDULER_REFUSALS:
            found.append(observation("hypnos_scheduler_admissions_rejected", 1))
        engine = self.reading.engine()
        if self.route == "/v1/chat/completions" and self.model_id:
            for name, field in [("hypnos_chat_ttft_ms", "ttft_ms"),
                                ("hypnos_chat_decode_tokens_per_s", "decode_tokens_per_s"),
                                ("hypnos_chat_prefill_tokens_per_s", "prefill_tokens_per_s")]:
                if isinstance(engine.get(field), (int, float)):
                    found.append(observation(name, engine[field], model=self.model_id))
        return found

    @property
    def model_id(self) -> str | None:
        """The pool's id the requested name stands for (an alias resolves), else the name."""
        from models_registry.live_pool import pool

        if not self.model_name:
            return None
        return next((m.id for m in pool.models() if self.model_name in (m.id, *m.aliases)), self.model_name)

    async def _log(self, status: int, duration_ms: float) -> None:
        threshold = await levels.get()
        level = entry_level(status, self.reading.error, self.cancelled)
        if is_kept(level, threshold):
            await sync_to_async(store_entry)(self.entry_fields(status, duration_ms, level, threshold))

    def entry_fields(self, status: int, duration_ms: float, level: str, threshold: str) -> dict[str, Any]:
        """The columns of this call's RequestLogEntry; text only as far as `threshold` captures."""
        reading = self.reading
        tokens_in, tokens_out, cached = reading.tokens()
        if self.cancelled and self.stream and tokens_out is None:
            # Cut before its usage chunk: what it generated is what it delivered.
            tokens_out = reading.deltas
        telemetry = reading.telemetry or {}
        fields: dict[str, Any] = {
            "request_id": self.request_id, "route": self.route, "method": self.request.method or "POST",
            "status": status, "key_label": self.principal.label if self.principal else None,
            "started_at": self.started_at, "duration_ms": round(duration_ms, 1), "model": self.model_id or "",
            "stream": self.stream, "tokens_in": tokens_in, "tokens_out": tokens_out, "cached_tokens": cached,
            "tokens_per_s": reading.tokens_per_s(), "inference_ms": telemetry.get("inference_latency_ms"),
            "tier_switch_ms": telemetry.get("tier_switch_latency_ms"),
            "previous_tier": telemetry.get("previous_tier") or "", "error": reading.error or "", "level": level,
            "finish_reason": CANCELLED if self.cancelled else reading.finish_reason or "",
        }
        truncated = False
        if level_rank(threshold) >= level_rank("debug"):
            redact = Redactor(settings.HYPNOS.server.request_log_redact)
            texts = {"input": _captured(input_text(self.body)), "output": reading.output}
            if level_rank(threshold) >= level_rank("trace"):
                texts["request_payload"] = _captured(self.raw_body)
                texts["response_payload"] = reading.payload
            for name, text in texts.items():
                fields[name] = redact(text.text())
                truncated = truncated or text.truncated
        fields["truncated"] = truncated
        return fields


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


def _route_label(request: HttpRequest) -> str:
    match = getattr(request, "resolver_match", None)
    if match is not None and match.route and "^" not in match.route:
        return "/" + match.route.removeprefix("api/")
    return "unmatched"


async def _count_http(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    started = getattr(request, "hypnos_started", None) or time.perf_counter()

    async def record() -> None:
        elapsed = (time.perf_counter() - started) * 1000
        try:
            await get_counters().record(_http_observations(_route_label(request), response.status_code, elapsed))
        except Exception:
            log.warning("counting %s failed", request.path, exc_info=True)

    if isinstance(response, StreamingHttpResponse) and response.is_async:
        response.streaming_content = _counted_stream(response.streaming_content, record)
    else:
        await record()
    return response


async def _counted_stream(content: AsyncIterator[bytes], record: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in content:
            yield chunk
    finally:
        await record()
