"""POST /v1/embeddings (spec §8, compat.md): one vector per input, in input order, as JSON floats
or as base64 little-endian float32 (what the OpenAI SDKs ask for by default)."""

from __future__ import annotations

import array
import asyncio
import base64
import sys

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from inference.client import InferenceClient
from inference.protocol_media import EmbeddingRequest
from inference.serving.chat import check_prompt_chars, request_timed_out
from inference.serving.context import RequestContext, resolve_model, start_call, with_wait_estimate
from inference.wire import Embedded, EmbedWork


async def create_embeddings(client: InferenceClient, body: EmbeddingRequest, ctx: RequestContext) -> HttpResponseBase:
    texts = body.texts()
    model = await resolve_model(client, body.model, ctx)
    check_prompt_chars(sum(len(t) for t in texts), "input")
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, _started = await asyncio.wait_for(start_call(client, model, EmbedWork(input=texts), ctx), timeout)
        drained = await asyncio.wait_for(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    base64_out = body.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode() if base64_out else _floats(v)}
        for i, v in enumerate(drained.vectors)
    ]
    done = drained.done
    assert isinstance(done.result, Embedded)
    tokens = done.result.prompt_tokens
    return with_wait_estimate(
        JsonResponse(
            {
                "object": "list",
                "model": body.model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "hypnos_telemetry": done.telemetry,
            }
        ),
        call,
    )


def _floats(raw: bytes) -> list[float]:
    values = array.array("f", raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
