"""POST /v1/chat/completions: request checks, the worker call, JSON or SSE (spec §7)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from inference.client import InferenceCall, InferenceClient
from inference.errors import HypnosError, InvalidRequest, ModelNotFound, ServerError
from inference.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 512
MEDIA_MODALITY = {"image_url": "vision", "input_audio": "speech_to_text"}


def chat_payload(body: ChatCompletionRequest) -> dict[str, Any]:
    """Check the request against the limits and the model, and build the worker's ChatWork."""
    hypnos = settings.HYPNOS
    model = next((m for m in hypnos.models if body.model in (m.id, *m.aliases)), None)
    if model is None:
        raise ModelNotFound(f"The model {body.model!r} does not exist; GET /v1/models lists the models.", param="model")
    for message in body.messages:
        for kind in message.media_kinds():
            if model.modality != MEDIA_MODALITY[kind]:
                raise InvalidRequest(
                    f"The model {model.id!r} does not serve {MEDIA_MODALITY[kind]}, so it cannot take {kind} parts.",
                    param="messages",
                )
    chars = sum(len(m.text()) for m in body.messages)
    if chars > hypnos.limits.max_prompt_chars:
        raise InvalidRequest(
            f"The messages hold {chars} characters, above limits.max_prompt_chars ({hypnos.limits.max_prompt_chars}).",
            param="messages",
        )
    requested = [v for v in (body.max_tokens, body.max_completion_tokens) if v is not None]
    max_tokens = min(min(requested) if requested else DEFAULT_MAX_TOKENS, hypnos.limits.max_tokens_cap)
    return {
        "messages": [{"role": m.role, "content": m.text()} for m in body.messages],
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": body.stop_list(),
        "num_ctx": body.num_ctx or body.ctx_size,
    }


async def create_chat_completion(client: InferenceClient, body: ChatCompletionRequest, request_id: str) -> HttpResponse:
    payload = chat_payload(body)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    try:
        call, _started = await asyncio.wait_for(client.start("chat", body.model, payload, request_id), timeout)
        if body.stream:
            return _stream_response(call, _ChunkMaker(completion_id, body.model))
        return JsonResponse(await asyncio.wait_for(_collect(call, completion_id, body.model), timeout))
    except asyncio.TimeoutError:
        return HttpResponse(
            f"request_timeout_secs ({timeout:g} s) elapsed", status=408, content_type="text/plain; charset=utf-8"
        )


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    shaped = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if usage.get("cached_tokens"):
        shaped["prompt_tokens_details"] = {"cached_tokens": usage["cached_tokens"]}
    return shaped


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


async def _collect(call: InferenceCall, completion_id: str, model: str) -> dict[str, Any]:
    text: list[str] = []
    try:
        async for event in call.events():
            if event["kind"] == "delta":
                text.append(event["text"])
            elif event["kind"] == "error":
                raise HypnosError.from_event(event)
            elif event["kind"] == "done":
                return {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(text)},
                            "finish_reason": _finish_reason(event["finish_reason"]),
                        }
                    ],
                    "usage": _usage(event["usage"]),
                    "hypnos_telemetry": event["telemetry"],
                }
    finally:
        if not call.finished:
            await call.abort()
    raise ServerError("the inference worker ended the request without a result")


class _ChunkMaker:
    def __init__(self, completion_id: str, model: str):
        self.base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def __call__(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
        chunk = {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _stream_response(call: InferenceCall, chunk: _ChunkMaker) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_sse(call, chunk), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _sse(call: InferenceCall, chunk: _ChunkMaker) -> AsyncIterator[str]:
    """The chunk sequence of spec §7.4. Closing the connection cancels this generator; its
    `finally` aborts the request so the engine stops at the next token."""
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in call.events():
            if event["kind"] == "delta":
                yield chunk({"content": event["text"]})
            elif event["kind"] == "done":
                yield chunk(
                    {},
                    _finish_reason(event["finish_reason"]),
                    usage=_usage(event["usage"]),
                    hypnos_telemetry=event["telemetry"],
                )
            elif event["kind"] == "error":
                error = HypnosError.from_event(event)
                yield chunk({}, "error", error={"message": error.message, "type": error.type})
        yield "data: [DONE]\n\n"
    except HypnosError as error:
        # The transport itself failed (a lost reply, a vanished worker): same error chunk.
        yield chunk({}, "error", error={"message": error.message, "type": error.type})
        yield "data: [DONE]\n\n"
    finally:
        if not call.finished:
            await asyncio.shield(call.abort())
