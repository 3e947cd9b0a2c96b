"""POST /v1/embeddings (spec §8, compat.md): one vector per input (a text or an array of the
model's token ids), in input order, as JSON floats or as base64 little-endian float32 (what the
OpenAI SDKs ask for by default)."""

from __future__ import annotations

import array
import base64
import sys

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.errors import InvalidRequest
from inference.transport.client import InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import Embedded, EmbedWork
from inference.web.common.context import RequestContext, resolve_model, start_call, with_wait_estimate
from inference.web.openai.protocol_media import EmbeddingRequest
from inference.web.openai.serving_chat import check_prompt_chars, request_timed_out


async def create_embeddings(client: InferenceClient, body: EmbeddingRequest, ctx: RequestContext) -> HttpResponseBase:
    inputs = body.inputs()
    model = await resolve_model(client, body.model, ctx)
    _check_size(inputs)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, _started = await within(start_call(client, model, EmbedWork(input=inputs), ctx), timeout)
        drained = await within(call.drain(), timeout)
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


def _check_size(inputs: list[str] | list[list[int]]) -> None:
    """limits.max_prompt_chars over the texts, or over the token ids (each stands for at least
    one character of a text)."""
    size = sum(len(i) for i in inputs)
    if inputs and isinstance(inputs[0], str):
        check_prompt_chars(size, "input")
        return
    limit = settings.HYPNOS.limits.max_prompt_chars
    if size > limit:
        raise InvalidRequest(
            f"The input holds {size} token ids, above limits.max_prompt_chars ({limit}).", param="input"
        )


def _floats(raw: bytes) -> list[float]:
    values = array.array("f", raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
