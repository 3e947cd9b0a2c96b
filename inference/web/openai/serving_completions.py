"""POST /v1/completions (compat.md): a prompt continued as is, no chat template."""

from __future__ import annotations

import json
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
from inference.transport.wire import Delta, Done, GenerateWork
from inference.web.common.context import RequestContext, resolve_model, start_call, with_wait_estimate
from inference.web.common.generation import record_stats
from inference.web.common.render import DONE, sse_error, sse_response
from inference.web.openai.protocol import CompletionRequest
from inference.web.openai.serving_chat import (
    check_prompt_chars,
    finish_reason,
    request_timed_out,
    sampling_payload,
    usage_of,
)
from logs.record import CallRecord


def completion_work(body: CompletionRequest, model: ModelConfig) -> GenerateWork:
    prompt = body.prompt_text()
    if not prompt:
        raise InvalidRequest("prompt is empty: send the text to continue.", param="prompt")
    check_prompt_chars(len(prompt), "prompt")
    return GenerateWork(
        **sampling_payload(body, model, body.max_tokens),
        messages=[],
        raw_prompt=prompt,
        top_logprobs=body.logprobs,
        prompt_param="prompt",
    )


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The completions API's column-wise logprobs from chat-style entries."""
    offsets, position = [], offset
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


async def create_completion(client: InferenceClient, body: CompletionRequest, ctx: RequestContext) -> HttpResponseBase:
    model = await resolve_model(client, body.model, ctx)
    work = completion_work(body, model)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    completion_id = "cmpl-" + uuid.uuid4().hex
    try:
        call, _ = await within(start_call(client, model, work, ctx), timeout)
        if body.stream:
            return with_wait_estimate(sse_response(_completion_sse(call, completion_id, body, ctx.record)), call)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    done = drained.done
    record_stats(done)
    choice = {
        "text": drained.text,
        "index": 0,
        "finish_reason": finish_reason(done.finish_reason),
        "logprobs": legacy_logprobs(drained.logprobs, 0) if body.logprobs is not None else None,
    }
    return with_wait_estimate(
        JsonResponse(
            {
                "id": completion_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [choice],
                "usage": usage_of(done.usage),
                "hypnos_telemetry": done.telemetry,
            }
        ),
        call,
    )


async def _completion_sse(
    call: InferenceCall, completion_id: str, body: CompletionRequest, record: CallRecord
) -> AsyncIterator[str]:
    base = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": body.model}
    offset = 0

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> dict[str, Any]:
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    def line(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async with call:
        try:
            async for event in call.events():
                if isinstance(event, Delta):
                    entries = event.logprobs or []
                    logprobs = legacy_logprobs(entries, offset) if body.logprobs is not None else None
                    offset += len(event.text)
                    yield line(chunk(event.text, logprobs=logprobs))
                elif isinstance(event, Done):
                    record_stats(event)
                    yield line(
                        chunk(
                            "",
                            finish_reason(event.finish_reason),
                            usage=usage_of(event.usage),
                            hypnos_telemetry=event.telemetry,
                        )
                    )
            yield DONE
        except HypnosError as error:
            yield sse_error(error, chunk("", "error"), record)
