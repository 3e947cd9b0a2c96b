"""POST /v1/entities (spec §13): zero-shot entities of free-text labels, on a GLiNER model or a
chat model serving entity_extraction. Offsets count Unicode scalar values (a Python `str`'s
indexes), so `input[start:end]` is each entity's text."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from inference.transport.client import InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import EntityWork
from inference.web.common.context import RequestContext, resolve_model, start_call, with_wait_estimate
from inference.web.openai.protocol_media import EntityRequest
from inference.web.openai.serving_chat import check_prompt_chars, request_timed_out


async def extract_entities(client: InferenceClient, body: EntityRequest, ctx: RequestContext) -> HttpResponseBase:
    limits = settings.HYPNOS.limits
    texts = body.texts()
    labels = body.checked_labels(limits.max_entity_labels)
    characters = sum(len(text) for text in texts)
    check_prompt_chars(characters, "input")
    model = await resolve_model(client, body.model, ctx)
    work = EntityWork(input=texts, labels=labels, threshold=body.threshold, flat=body.flat)
    timeout = limits.request_timeout_secs
    try:
        call, _started = await within(start_call(client, model, work, ctx), timeout)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    data = [
        {
            "object": "entities",
            "index": index,
            "entities": [
                {
                    "text": text[span.start : span.end],
                    "label": span.label,
                    "start": span.start,
                    "end": span.end,
                    "score": span.score,
                }
                for span in drained.entities.get(index, [])
            ],
        }
        for index, text in enumerate(texts)
    ]
    return with_wait_estimate(
        JsonResponse(
            {
                "object": "list",
                "model": body.model,
                "data": data,
                "usage": {"texts": len(texts), "characters": characters},
                "hypnos_telemetry": drained.done.telemetry,
            }
        ),
        call,
    )
