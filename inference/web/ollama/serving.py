"""The Ollama API's inference routes (issue 17): POST /api/chat, /api/generate, /api/embed and
/api/embeddings, translated onto the typed work of /v1 (GenerateWork, EmbedWork) and the same
call: the model is found, the request checked and the worker has started it before the first
byte, so every refusal is a status with Ollama's `{"error": "..."}`; a stream is Ollama's NDJSON,
one JSON object per line, the last with `done: true`, the reason and the timings (nanoseconds).

An empty chat or prompt loads the model into tier 1 and answers `done_reason: "load"`, as
Ollama's clients expect; `keep_alive: 0` demotes the model to tier 2 once it has answered
(`"unload"`), which, as every tier move, needs an admin key when keys are configured.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from django.conf import settings
from django.http import HttpResponseBase, JsonResponse, StreamingHttpResponse

from hypnos_site.config import ModelConfig
from hypnos_site.errors import HypnosError, InvalidRequest, ModelBusy, PermissionDenied, RequestTimeout
from inference.transport.client import Drained, InferenceCall, InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import IMAGE_MARKER, Delta, Done, Embedded, EmbedWork, GenerateWork, Reasoning, Usage
from inference.web.common import image_input
from inference.web.common.context import RequestContext, check_prompt_chars, start_call, with_wait_estimate
from inference.web.common.generation import capped_max_tokens, check_grammars, model_defaults, record_stats
from inference.web.common.protocol import THINKING_BUDGETS
from inference.web.common.render import ollama_ndjson_error
from inference.web.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    Message,
    Options,
    Think,
)
from inference.web.ollama.serving_models import TIER1, find_model, timestamp
from logs.record import CallRecord
from models_registry.authentication import ADMIN_ONLY

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
CHAT_MODALITIES = ("text_generation", "vision")
SAMPLING = ("temperature", "top_p", "top_k", "repeat_penalty", "frequency_penalty", "presence_penalty")
# How long an unload waits for the request that just ended to give its lease back.
UNLOAD_WAIT_SECS = 5.0


# -- what the routes share ---------------------------------------------------------------------


async def resolve(
    client: InferenceClient, name: str, ctx: RequestContext, modalities: tuple[str, ...], verb: str
) -> ModelConfig:
    """The pool's model of an Ollama name that serves `verb` (400 in Ollama's words when it
    does not); noted in the call's record."""
    model = await find_model(client, name)
    ctx.record.model = model.id
    if model.modality not in modalities:
        raise InvalidRequest(f'"{name}" does not support {verb}', param="model")
    return model


def keep_alive_of(keep_alive_secs: float | None, admin: bool) -> float | None:
    """The request's keep_alive in seconds (0: demote the model once it has answered; negative:
    keep it forever), or None when it sets none. It changes how long the model stays loaded for
    every client, so admin keys only."""
    if keep_alive_secs is None:
        return None
    if not admin:
        raise PermissionDenied(f"{ADMIN_ONLY} keep_alive sets how long the model stays loaded.")
    return keep_alive_secs


def keep_alive_after(
    client: InferenceClient, model: ModelConfig, secs: float | None
) -> Callable[[], Awaitable[None]] | None:
    """What runs once the answer is complete: keep_alive 0 unloads; any other value becomes the
    model's idle unload time from now (the worker's `keep_alive`)."""
    if secs is None:
        return None
    if secs == 0:
        return lambda: unload(client, model)

    async def keep() -> None:
        await client.control("keep_alive", {"model": model.id, "secs": secs})

    return keep


def sampling(options: Options, model: ModelConfig) -> dict[str, Any]:
    """GenerateWork's sampling fields from Ollama's options, the model's defaults filling the
    ones a request leaves out (as on /v1)."""
    picked = {k: v for k, v in model_defaults(options, model, *SAMPLING).items() if v is not None}
    return {
        **picked,
        "max_tokens": capped_max_tokens(options.max_tokens(), model),
        "seed": options.seed,
        "stop": options.stop_list(),
        "num_ctx": options.num_ctx,
    }


def thinking(think: Think | None) -> tuple[bool, int | None]:
    """`think` as (thinking on, thought-token budget): true, or a level as reasoning_effort's."""
    if think is None or think is False:
        return False, None
    if think is True:
        return True, None
    return True, THINKING_BUDGETS[think]


def decode_images(encoded: list[str], model: ModelConfig) -> list[bytes]:
    """Ollama's base64 images, each checked as /v1 checks an image part; 400 for a model
    without vision."""
    if encoded and "vision" not in model.modalities:
        raise InvalidRequest(f"The model {model.id!r} does not serve vision, so it cannot take images.", param="images")
    limits = settings.HYPNOS.limits
    images = []
    for index, text in enumerate(encoded):
        if len(text) * 3 // 4 > limits.max_image_bytes + 3:
            raise InvalidRequest(
                f"images[{index}] is above limits.max_image_bytes ({limits.max_image_bytes}).", param="images"
            )
        try:
            data = base64.b64decode(text.partition(",")[2] if text.startswith("data:") else text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"images[{index}] is not valid base64.", param="images") from None
        image_input.check_image(data, limits.max_image_pixels, param="images")
        images.append(data)
    return images


def worker_messages(messages: list[Message], model: ModelConfig) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Ollama's messages as the worker's (OpenAI's) and their images in order: each image as
    IMAGE_MARKER before its message's text, tool calls with their arguments as JSON text."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for message in messages:
        pictures = decode_images(message.images or [], model)
        images += pictures
        text = IMAGE_MARKER * len(pictures) + (message.content or "").replace(IMAGE_MARKER, "")
        shaped: dict[str, Any] = {"role": message.role, "content": text}
        if message.tool_calls:
            shaped["tool_calls"] = [
                {
                    "id": call.id or f"call_{len(out)}_{index}",
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)},
                }
                for index, call in enumerate(message.tool_calls)
            ]
        if message.role == "tool" and message.tool_name:
            shaped["name"] = message.tool_name
        out.append(shaped)
    return out, images


def nanoseconds(ms: Any) -> int:
    """Milliseconds of the telemetry as Ollama's nanoseconds (0 when the telemetry has none)."""
    return int(float(ms) * 1_000_000) if isinstance(ms, int | float) else 0


def done_fields(done: Done, started: float) -> dict[str, Any]:
    """The last object's fields: why it ended, the token counts and Ollama's durations (ns)."""
    usage = done.usage or Usage()
    engine = done.telemetry.get("engine") or {}
    return {
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": nanoseconds(done.telemetry.get("tier_switch_latency_ms")),
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": nanoseconds(engine.get("prefill_ms")),
        "eval_count": usage.completion_tokens,
        "eval_duration": nanoseconds(engine.get("decode_ms")),
        "hypnos_telemetry": done.telemetry,
    }


def tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker's (OpenAI's) tool calls as Ollama's: the arguments an object."""
    shaped = []
    for index, call in enumerate(calls):
        function = call["function"]
        arguments = function["arguments"]
        shaped.append(
            {
                "id": call.get("id"),
                "function": {
                    "index": call.get("index", index),
                    "name": function["name"],
                    "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments,
                },
            }
        )
    return shaped


@dataclass
class Shape:
    """The objects of one route: chat's `message`, or generate's `response` (and `thinking`)."""

    model: str
    chat: bool

    def piece(self, text: str = "", thoughts: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        base: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thoughts:
                message["thinking"] = thoughts
            if calls:
                message["tool_calls"] = tool_calls(calls)
            return {**base, "message": message, "done": False}
        found = {**base, "response": text, "done": False}
        if thoughts:
            found["thinking"] = thoughts
        return found


def now() -> str:
    """`created_at`: RFC 3339 in UTC."""
    return timestamp(datetime.now(UTC))


def line(payload: dict[str, Any]) -> str:
    """One NDJSON line."""
    return json.dumps(payload, ensure_ascii=False) + "\n"


def ndjson_response(lines: AsyncIterator[str]) -> StreamingHttpResponse:
    """A stream of NDJSON lines, unbuffered by proxies."""
    response = StreamingHttpResponse(lines, content_type=NDJSON)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


# -- tier moves: load, unload ------------------------------------------------------------------


async def _tier(client: InferenceClient, model: ModelConfig) -> str | None:
    status = await client.status()
    return None if status is None else status["models"].get(model.id, {}).get("current_tier")


async def load(client: InferenceClient, model: ModelConfig) -> None:
    """Promote the model to tier 1 unless it is there; a model that is serving is loaded already."""
    if await _tier(client, model) == TIER1:
        return
    try:
        await client.control("move", {"model": model.id, "target_tier": TIER1})
    except ModelBusy:
        pass


async def unload(client: InferenceClient, model: ModelConfig) -> None:
    """Demote the model from tier 1 to tier 2 once the request that just ended gives its lease
    back (a moment after its last event); a model that other requests keep busy stays."""
    deadline = time.monotonic() + UNLOAD_WAIT_SECS
    while await _tier(client, model) == TIER1:
        try:
            await client.control("move", {"model": model.id, "target_tier": "tier2_pinned_ram"})
            return
        except ModelBusy:
            if time.monotonic() > deadline:
                log.info("keep_alive 0: %s stays in tier 1, it is serving other requests", model.id)
                return
            await asyncio.sleep(0.05)


async def load_only(
    client: InferenceClient, model: ModelConfig, shape: Shape, keep_alive: float | None
) -> JsonResponse:
    """An empty chat or prompt: load the model (for keep_alive seconds when given), or with
    keep_alive 0 unload it."""
    unloading = keep_alive == 0
    if not unloading:
        await load(client, model)
    after = keep_alive_after(client, model, keep_alive)
    if after is not None:
        await after()
    piece = shape.piece()
    return JsonResponse({**piece, "done": True, "done_reason": "unload" if unloading else "load"})


# -- chat and generate -------------------------------------------------------------------------


async def create_chat(
    client: InferenceClient, body: ChatRequest, ctx: RequestContext, *, admin: bool
) -> HttpResponseBase:
    """POST /api/chat."""
    started = time.perf_counter()
    model = await resolve(client, body.model, ctx, CHAT_MODALITIES, "chat")
    keep_alive = keep_alive_of(body.keep_alive_secs(), admin)
    shape = Shape(body.model, chat=True)
    if not body.messages:
        return await load_only(client, model, shape, keep_alive)
    messages, images = worker_messages(body.messages, model)
    check_prompt_chars(sum(len(m.content or "") for m in body.messages), "messages")
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    schema = body.json_schema()
    check_grammars(schema, "format", tools, "auto")
    think, budget = thinking(body.think)
    work = GenerateWork(
        **sampling(body.options, model),
        messages=messages,
        images=images,
        tools=tools,
        json_schema=schema,
        schema_param="format",
        think=think,
        thinking_budget=budget,
    )
    after = keep_alive_after(client, model, keep_alive)
    return await run(client, model, work, ctx, shape, body.stream, started, after)


def generate_work(body: GenerateRequest, model: ModelConfig) -> GenerateWork:
    """The prompt through the model's chat template (with `system`), or as it is with `raw`."""
    if body.template:
        raise InvalidRequest(
            "template is not supported: Hypnos renders the model's own chat template; "
            "send raw: true with a prompt formatted as the model expects.",
            param="template",
        )
    if body.context:
        raise InvalidRequest(
            "context (the tokens of an earlier answer) is not supported; send the conversation to /api/chat.",
            param="context",
        )
    if body.suffix:
        raise InvalidRequest(f'"{body.model}" does not support insert', param="suffix")
    prompt = body.prompt or ""
    check_prompt_chars(len(prompt) + len(body.system or ""), "prompt")
    schema = body.json_schema()
    check_grammars(schema, "format", None, "auto")
    think, budget = thinking(body.think)
    common: dict[str, Any] = {
        **sampling(body.options, model),
        "json_schema": schema,
        "schema_param": "format",
        "prompt_param": "prompt",
        "think": think,
        "thinking_budget": budget,
    }
    if body.raw:
        if body.images:
            raise InvalidRequest("images need raw: false (the template places them).", param="images")
        return GenerateWork(**common, messages=[], raw_prompt=prompt)
    images = decode_images(body.images or [], model)
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": IMAGE_MARKER * len(images) + prompt.replace(IMAGE_MARKER, "")})
    return GenerateWork(**common, messages=messages, images=images)


async def create_generate(
    client: InferenceClient, body: GenerateRequest, ctx: RequestContext, *, admin: bool
) -> HttpResponseBase:
    """POST /api/generate."""
    started = time.perf_counter()
    model = await resolve(client, body.model, ctx, CHAT_MODALITIES, "generate")
    keep_alive = keep_alive_of(body.keep_alive_secs(), admin)
    shape = Shape(body.model, chat=False)
    if not body.prompt and not body.images:
        return await load_only(client, model, shape, keep_alive)
    work = generate_work(body, model)
    after = keep_alive_after(client, model, keep_alive)
    return await run(client, model, work, ctx, shape, body.stream, started, after)


async def run(
    client: InferenceClient,
    model: ModelConfig,
    work: GenerateWork,
    ctx: RequestContext,
    shape: Shape,
    stream: bool,
    started: float,
    after: Callable[[], Awaitable[None]] | None,
) -> HttpResponseBase:
    """Start the call (every refusal raises here, before any byte), then answer it whole or
    as NDJSON; `after` runs once the answer is complete (the unload of keep_alive 0)."""
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, _ = await within(start_call(client, model, work, ctx), timeout)
        if stream:
            return with_wait_estimate(ndjson_response(_lines(call, shape, started, ctx.record, after)), call)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        raise RequestTimeout(f"request_timeout_secs ({timeout:g} s) elapsed") from None
    record_stats(drained.done)
    answer = {**_whole(shape, drained), **done_fields(drained.done, started)}
    if after is not None:
        await after()
    return with_wait_estimate(JsonResponse(answer), call)


def _whole(shape: Shape, drained: Drained) -> dict[str, Any]:
    return shape.piece(drained.text, drained.reasoning, drained.done.tool_calls)


async def _lines(
    call: InferenceCall,
    shape: Shape,
    started: float,
    record: CallRecord,
    after: Callable[[], Awaitable[None]] | None,
) -> AsyncIterator[str]:
    """One object per delta, tool calls in an object of their own, then the `done` object; a
    failure once the headers are out is an `{"error": ...}` line. Closing the connection
    cancels this generator; leaving `async with call` aborts the request."""
    async with call:
        try:
            async for event in call.events():
                if isinstance(event, Delta) and event.text:
                    yield line(shape.piece(event.text))
                elif isinstance(event, Reasoning) and event.text:
                    yield line(shape.piece(thoughts=event.text))
                elif isinstance(event, Done):
                    record_stats(event)
                    if event.tool_calls:
                        yield line(shape.piece(calls=event.tool_calls))
                    yield line({**shape.piece(), **done_fields(event, started)})
        except HypnosError as error:
            yield ollama_ndjson_error(error, record)
            return
    if after is not None:
        await after()


# -- embeddings --------------------------------------------------------------------------------


async def _vectors(client: InferenceClient, model: ModelConfig, texts: list[str], ctx: RequestContext) -> Drained:
    check_prompt_chars(sum(len(t) for t in texts), "input")
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        call, _ = await within(start_call(client, model, EmbedWork(input=texts), ctx), timeout)
        return await within(call.drain(), timeout)
    except TimeoutError:
        raise RequestTimeout(f"request_timeout_secs ({timeout:g} s) elapsed") from None


def floats(raw: bytes, dimensions: int | None = None) -> list[float]:
    """A little-endian float32 vector as floats; cut to `dimensions` and normalized again when
    asked (as Ollama shortens an embedding)."""
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector.tolist()  # type: ignore[no-any-return]


def embedded_tokens(done: Done) -> int:
    """The prompt tokens an embed op reports in its result."""
    return done.result.prompt_tokens if isinstance(done.result, Embedded) else 0


async def _embedded(
    client: InferenceClient, body: EmbedRequest | EmbeddingsRequest, texts: list[str], ctx: RequestContext, admin: bool
) -> Drained:
    """The vectors of an embed route, its keep_alive applied once they are there."""
    model = await resolve(client, body.model, ctx, ("embeddings",), "embeddings")
    after = keep_alive_after(client, model, keep_alive_of(body.keep_alive_secs(), admin))
    drained = await _vectors(client, model, texts, ctx)
    if after is not None:
        await after()
    return drained


async def create_embed(client: InferenceClient, body: EmbedRequest, ctx: RequestContext, admin: bool) -> JsonResponse:
    """POST /api/embed: one vector per input, the vectors of /v1/embeddings."""
    started = time.perf_counter()
    drained = await _embedded(client, body, body.texts(), ctx, admin)
    done = drained.done
    return JsonResponse(
        {
            "model": body.model,
            "embeddings": [floats(v, body.dimensions) for v in drained.vectors],
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": nanoseconds(done.telemetry.get("tier_switch_latency_ms")),
            "prompt_eval_count": embedded_tokens(done),
            "hypnos_telemetry": done.telemetry,
        }
    )


async def create_embeddings(
    client: InferenceClient, body: EmbeddingsRequest, ctx: RequestContext, admin: bool
) -> JsonResponse:
    """POST /api/embeddings, the older route: one prompt, one `embedding`."""
    drained = await _embedded(client, body, [body.prompt], ctx, admin)
    return JsonResponse({"embedding": floats(drained.vectors[0])})
