"""POST /v1/embeddings (spec §8, compat.md): one vector per input, in input order, as JSON floats
or as base64 little-endian float32 (what the OpenAI SDKs ask for by default)."""

from __future__ import annotations

import array
import asyncio
import base64
import sys
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse

from inference.client import InferenceCall, InferenceClient
from hypnos_site.errors import HypnosError, ServerError
from inference.protocol_media import EmbeddingRequest
from inference.serving.chat import check_prompt_chars, find_model, request_timed_out
from inference.serving.context import RequestContext, with_wait_estimate
from inference.serving.pool import pool


async def create_embeddings(client: InferenceClient, body: EmbeddingRequest, ctx: RequestContext) -> HttpResponse:
    texts = body.texts()
    await pool.ensure(client, body.model)
    find_model(body.model)
    check_prompt_chars(sum(len(t) for t in texts), "input")
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, _started = await asyncio.wait_for(
            client.start("embed", body.model, {"input": texts}, ctx.request_id, ctx.deadline_ms, ctx.next_model),
            timeout,
        )
        vectors, done = await asyncio.wait_for(collect_vectors(call), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    data = [
        {"object": "embedding", "index": i, "embedding": v if body.encoding_format == "base64" else _floats(v)}
        for i, v in enumerate(vectors)
    ]
    tokens = done["result"]["prompt_tokens"]
    return with_wait_estimate(JsonResponse({
        "object": "list",
        "model": body.model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "hypnos_telemetry": done["telemetry"],
    }), call)


async def collect_vectors(call: InferenceCall) -> tuple[list[str], dict[str, Any]]:
    """The vectors (base64 float32, in input order) and the `done` event of an embed call."""
    vectors: list[str] = []
    try:
        async for event in call.events():
            if event["kind"] == "vectors":
                vectors += event["data"]
            elif event["kind"] == "error":
                raise HypnosError.from_event(event)
            elif event["kind"] == "done":
                return vectors, event
    finally:
        if not call.finished:
            await call.abort()
    raise ServerError("the inference worker ended the request without a result")


def _floats(encoded: str) -> list[float]:
    values = array.array("f", base64.b64decode(encoded))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
