"""POST /v1/chat/completions: request checks, the worker call, JSON or SSE (spec §7)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.config import ModelConfig
from hypnos_site.errors import HypnosError, InvalidRequest
from inference.transport.client import InferenceCall, InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import Delta, Done, GenerateWork, Reasoning, Usage
from inference.web.common import image_input
from inference.web.common.context import (
    RequestContext,
    check_prompt_chars,
    request_timed_out,
    resolve_model,
    start_call,
    with_wait_estimate,
)
from inference.web.common.generation import capped_max_tokens, check_grammars, model_defaults, record_stats
from inference.web.common.pool import pool
from inference.web.common.render import DONE, sse_error, sse_response
from inference.web.openai import serving_voice as voice
from inference.web.openai.protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from logs.record import CallRecord

log = logging.getLogger(__name__)
MEDIA_MODALITY = {"image_url": "vision", "input_audio": "speech_to_text"}


def find_model(name: str) -> ModelConfig:
    """The pool's model that `name` (an id or an alias) stands for; 404 model_not_found."""
    return pool.find(name)


def sampling_payload(body: SamplingFields, model: ModelConfig, max_tokens: int | None) -> dict[str, Any]:
    """The worker fields every text route shares."""
    return {
        "max_tokens": capped_max_tokens(max_tokens, model),
        **model_defaults(
            body, model, "temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "repeat_penalty"
        ),
        "seed": body.seed,
        "stop": body.stop_list(),
        "num_ctx": body.num_ctx or body.ctx_size,
    }


def worker_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text_with_images(),
    }
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def chat_work(body: ChatCompletionRequest, model: ModelConfig, images: list[bytes] | None = None) -> GenerateWork:
    """Check the request against the limits and the model, and build the worker's work."""
    for message in body.messages:
        for kind in message.media_kinds():
            if MEDIA_MODALITY[kind] not in model.modalities:
                raise InvalidRequest(
                    f"The model {model.id!r} does not serve {MEDIA_MODALITY[kind]}, so it cannot take {kind} parts.",
                    param="messages",
                )
    check_prompt_chars(sum(len(m.text()) for m in body.messages), "messages")
    requested = [v for v in (body.max_tokens, body.max_completion_tokens) if v is not None]
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    schema = body.response_format.schema_or_none() if body.response_format else None
    check_grammars(schema, "response_format", tools, body.tool_choice_value())
    think, budget = body.thinking_request()
    return GenerateWork(
        **sampling_payload(body, model, min(requested) if requested else None),
        messages=[worker_message(m) for m in body.messages],
        tools=tools,
        tool_choice=body.tool_choice_value(),
        json_schema=schema,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        think=think,
        thinking_budget=budget,
        images=images or [],
    )


async def load_images(body: ChatCompletionRequest) -> list[bytes]:
    """The images of the messages' image_url parts, in order (data: URLs and remote fetches)."""
    policy = image_input.ImagePolicy.from_limits(settings.HYPNOS.limits)
    return [await image_input.load_image(url, policy) for m in body.messages for url in m.image_urls()]


async def create_chat_completion(
    client: InferenceClient, body: ChatCompletionRequest, ctx: RequestContext
) -> HttpResponseBase:
    model = await resolve_model(client, body.model, ctx)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    try:
        # input_audio on a chat model that hears through a speech_to_text model: transcribe first.
        body, stages = await within(voice.transcribe_audio_parts(client, body, model, ctx), timeout)
        work = chat_work(body, model)
        work = work.model_copy(update={"images": await within(load_images(body), timeout)})
        call, _started = await within(start_call(client, model, work, ctx), timeout)
        call = voice.reporting(call, stages, model.id)
        ctx.record.stages = stages
        if body.stream:
            chunks = _chat_sse(call, _ChunkMaker(completion_id, body.model), body.logprobs, ctx.record)
            return with_wait_estimate(sse_response(chunks), call)
        return with_wait_estimate(JsonResponse(await within(_chat_json(call, completion_id, body), timeout)), call)
    except TimeoutError:
        return request_timed_out(timeout)


def usage_of(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    shaped: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens:
        shaped["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return shaped


def finish_reason(reason: str | None) -> str:
    return reason if reason in ("length", "tool_calls") else "stop"


async def _chat_json(call: InferenceCall, completion_id: str, body: ChatCompletionRequest) -> dict[str, Any]:
    drained = await call.drain()
    done = drained.done
    record_stats(done)
    message: dict[str, Any] = {"role": "assistant", "content": drained.text}
    if drained.reasoning:
        message["reasoning_content"] = drained.reasoning
    if done.tool_calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in done.tool_calls]
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(done.finish_reason)}
    if body.logprobs:
        choice["logprobs"] = {"content": drained.logprobs}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [choice],
        "usage": usage_of(done.usage),
        "hypnos_telemetry": done.telemetry,
    }


class _ChunkMaker:
    def __init__(self, completion_id: str, model: str):
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def __call__(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return f"data: {json.dumps(self.chunk(delta, finish, logprobs, **extra), ensure_ascii=False)}\n\n"

    def chunk(
        self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return {**self.base, "choices": [choice], **extra}


async def _chat_sse(
    call: InferenceCall, chunk: _ChunkMaker, with_logprobs: bool, record: CallRecord
) -> AsyncIterator[str]:
    """The chunk sequence of spec §7.4. Closing the connection cancels this generator; leaving
    `async with call` aborts the request so the engine stops at the next token."""
    async with call:
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for event in call.events():
                if isinstance(event, Delta):
                    extra: dict[str, Any] = {"logprobs": {"content": event.logprobs or []}} if with_logprobs else {}
                    yield chunk({"content": event.text}, **extra)
                elif isinstance(event, Reasoning):
                    yield chunk({"reasoning_content": event.text})
                elif isinstance(event, Done):
                    record_stats(event)
                    for tool_call in event.tool_calls:
                        yield chunk({"tool_calls": [tool_call]})
                    yield chunk(
                        {},
                        finish_reason(event.finish_reason),
                        usage=usage_of(event.usage),
                        hypnos_telemetry=event.telemetry,
                    )
            yield DONE
        except HypnosError as error:
            # An error event, or the transport failed (a lost reply, a vanished worker).
            yield sse_error(error, chunk.chunk({}, "error"), record)
