"""POST /v1/messages and /v1/messages/count_tokens (issue 17): Anthropic's Messages API over the
chat engine, translated onto the worker's GenerateWork like /v1/responses.

The conversation becomes the chat messages the GGUF's template renders (tool_use blocks as
assistant tool calls, tool_result blocks as tool messages, image blocks as the chat route's image
parts); the worker's events become Anthropic's message object or its named SSE events. Every
refusal comes before the first byte, in Anthropic's error envelope (render.anthropic_error); a
failure after it is one `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.config import ModelConfig
from hypnos_site.errors import HypnosError, InvalidRequest
from inference.transport.client import Drained, InferenceCall, InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import IMAGE_MARKER, Delta, Done, GenerateWork, Reasoning, Started, Usage
from inference.web.anthropic.protocol import (
    ImageBlockParam,
    MessageCountTokensParams,
    MessageCreateParams,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingConfigAdaptive,
    ThinkingConfigEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
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
from inference.web.common.render import anthropic_sse_error, sse_response
from logs.record import CallRecord

# Between the text blocks of one turn (and of `system`): each block reads as its own paragraph.
BLOCK_SEPARATOR = "\n\n"
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
PENALTIES = ("frequency_penalty", "presence_penalty", "repeat_penalty")

# -- the request ------------------------------------------------------------------------------


def _plain(text: str) -> str:
    """Text as the worker takes it: an image marker typed in it is removed (markers and images
    must pair up)."""
    return text.replace(IMAGE_MARKER, "")


def _joined(parts: list[str]) -> str:
    """A turn's pieces: text blocks a paragraph apart, each image marker where its block stood
    (the images of the chat route's parts are placed the same way)."""
    joined = ""
    for index, part in enumerate(parts):
        if index and IMAGE_MARKER not in (part, parts[index - 1]):
            joined += BLOCK_SEPARATOR
        joined += part
    return joined


def worker_messages(body: MessageCountTokensParams) -> tuple[list[dict[str, Any]], list[ImageBlockParam]]:
    """The conversation as the worker's chat messages (OpenAI's shape, which the chat templates
    take), and its image blocks in the order of their markers."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else BLOCK_SEPARATOR.join(b.text for b in body.system)
        messages.append({"role": "system", "content": _plain(system)})
    images: list[ImageBlockParam] = []
    for index, message in enumerate(body.messages):
        param = f"messages.{index}.content"
        if message.role == "user":
            messages += _user_turn(message.content, images, param)
        else:
            messages.append(_assistant_turn(message.content, param))
    if body.messages[-1].role != "user":
        raise InvalidRequest(
            "The last message is an assistant turn; continuing it (prefill) is not served here: end with a user turn.",
            param="messages",
        )
    return messages, images


def _user_turn(blocks: list[Any], images: list[ImageBlockParam], param: str) -> list[dict[str, Any]]:
    """A user turn: each tool_result block a tool message, the text and images around them user
    messages, in their order."""
    turn: list[dict[str, Any]] = []
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlockParam):
            parts.append(_plain(block.text))
        elif isinstance(block, ImageBlockParam):
            parts.append(IMAGE_MARKER)
            images.append(block)
        elif isinstance(block, ToolResultBlockParam):
            if parts:
                turn.append({"role": "user", "content": _joined(parts)})
                parts = []
            turn.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, param)})
        else:
            raise InvalidRequest(f"A user turn cannot hold a {block.type} block.", param=param)
    if parts:
        turn.append({"role": "user", "content": _joined(parts)})
    return turn


def _result_text(block: ToolResultBlockParam, param: str) -> str:
    if isinstance(block.content, str):
        return _plain(block.content)
    if any(isinstance(part, ImageBlockParam) for part in block.content):
        raise InvalidRequest("Image blocks inside a tool_result are not served; send text.", param=param)
    return BLOCK_SEPARATOR.join(_plain(part.text) for part in block.content if isinstance(part, TextBlockParam))


def _assistant_turn(blocks: list[Any], param: str) -> dict[str, Any]:
    """An assistant turn: its text, its tool_use blocks as tool calls; earlier thoughts are left
    out (the chat templates render none)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlockParam):
            texts.append(_plain(block.text))
        elif isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, ThinkingBlockParam | RedactedThinkingBlockParam):
            raise InvalidRequest(f"An assistant turn cannot hold a {block.type} block.", param=param)
    message: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def tool_choice(body: MessageCountTokensParams) -> str | dict[str, str]:
    """ "auto" | "none" | "required" | {"name": ...}: Anthropic's auto, none, any and tool."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, ToolChoiceAuto):
        return "auto"
    if isinstance(choice, ToolChoiceNone):
        return "none"
    names = {tool.name for tool in body.tools or []}
    if not names:
        raise InvalidRequest(f"tool_choice {choice.type!r} needs tools, and none were sent.", param="tool_choice")
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if choice.name not in names:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools.", param="tool_choice")
    return {"name": choice.name}


def thinking_request(body: MessageCountTokensParams) -> tuple[bool, int | None]:
    """(thinking on, thought-token budget or None). A model without a thinking format ignores
    it, as the chat route's think fields are ignored."""
    if isinstance(body.thinking, ThinkingConfigEnabled):
        return True, body.thinking.budget_tokens
    return isinstance(body.thinking, ThinkingConfigAdaptive), None


async def _prompt_fields(body: MessageCountTokensParams, model: ModelConfig) -> dict[str, Any]:
    """The GenerateWork fields that shape the prompt, checked: a generation and its count share
    them, so count_tokens counts exactly the prompt /v1/messages evaluates."""
    messages, image_blocks = worker_messages(body)
    if image_blocks and "vision" not in model.modalities:
        raise InvalidRequest(
            f"The model {model.id!r} does not serve vision, so it cannot take image blocks.", param="messages"
        )
    check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in body.tools or []
    ]
    choice = tool_choice(body)
    output_format = body.output_config.format if body.output_config else None
    schema = output_format.schema_ if output_format else None
    check_grammars(schema, "output_config.format", tools, choice)
    think, budget = thinking_request(body)
    policy = image_input.ImagePolicy.from_limits(settings.HYPNOS.limits)
    images = [await image_input.load_image(block.url(), policy) for block in image_blocks]
    return {
        "messages": messages,
        "tools": tools or None,
        "tool_choice": choice,
        "json_schema": schema,
        "schema_param": "output_config.format",
        "think": think,
        "thinking_budget": budget,
        "images": images,
    }


async def message_work(body: MessageCreateParams, model: ModelConfig) -> GenerateWork:
    """The worker's work of a /v1/messages request."""
    fields = await _prompt_fields(body, model)
    budget = fields["thinking_budget"]
    if budget is not None and budget >= body.max_tokens:
        raise InvalidRequest(
            f"max_tokens ({body.max_tokens}) must be greater than thinking.budget_tokens ({budget}).",
            param="thinking.budget_tokens",
        )
    # The model's own penalty defaults ([models.sampling], saved options): Anthropic sends none.
    penalties = {name: value for name in PENALTIES if (value := getattr(model.sampling, name)) is not None}
    return GenerateWork(
        **fields,
        **model_defaults(body, model, "temperature", "top_p", "top_k"),
        **penalties,
        max_tokens=capped_max_tokens(body.max_tokens, model),
        stop=body.stop_sequences or [],
    )


async def count_work(body: MessageCountTokensParams, model: ModelConfig) -> GenerateWork:
    """The worker's work of a count_tokens request: the same prompt, counted, never run."""
    return GenerateWork(**await _prompt_fields(body, model), max_tokens=1, count_only=True)


# -- the answer -------------------------------------------------------------------------------


def usage_of(usage: Usage | None) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens evaluated anew, the ones the
    prefix cache held are `cache_read_input_tokens` (their sum is the whole prompt)."""
    usage = usage or Usage()
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def stop_reason(done: Done) -> str:
    """end_turn, max_tokens, stop_sequence (a stop string ended it) or tool_use."""
    if done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(done.finish_reason or "", "end_turn")


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An engine's tool call as a tool_use block (its arguments are always a JSON object)."""
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


class _MessageMaker:
    """The message object, shared by the JSON and the streamed forms."""

    def __init__(self, model: str):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model

    def message(self, content: list[dict[str, Any]], done: Done | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(done) if done else None,
            "stop_sequence": done.stop_sequence if done else None,
            "usage": usage,
        }

    def finished(self, drained: Drained) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if drained.reasoning:
            content.append({"type": "thinking", "thinking": drained.reasoning, "signature": ""})
        if drained.text:
            content.append({"type": "text", "text": drained.text})
        content += [tool_use(call) for call in drained.done.tool_calls]
        body = self.message(content, drained.done, usage_of(drained.done.usage))
        body["hypnos_telemetry"] = drained.done.telemetry
        return body


async def create_message(client: InferenceClient, body: MessageCreateParams, ctx: RequestContext) -> HttpResponseBase:
    """POST /v1/messages: the message, or its stream of named events."""
    model = await resolve_model(client, body.model, ctx)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    maker = _MessageMaker(body.model)
    try:
        work = await within(message_work(body, model), timeout)
        call, started = await within(start_call(client, model, work, ctx), timeout)
        if body.stream:
            return with_wait_estimate(sse_response(_message_events(call, started, maker, ctx.record)), call)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    record_stats(drained.done)
    return with_wait_estimate(JsonResponse(maker.finished(drained)), call)


async def count_tokens(
    client: InferenceClient, body: MessageCountTokensParams, ctx: RequestContext
) -> HttpResponseBase:
    """POST /v1/messages/count_tokens: `{"input_tokens": N}`, the prompt rendered with the
    model's chat template and counted with its tokenizer in the worker (which loads the model)."""
    model = await resolve_model(client, body.model, ctx)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    try:
        work = await within(count_work(body, model), timeout)
        call, _ = await within(start_call(client, model, work, ctx), timeout)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    usage = drained.done.usage or Usage()
    return JsonResponse({"input_tokens": usage.prompt_tokens})


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a stream: at most one open at a time, numbered in order."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.open = kind
        events.append(_event("content_block_start", index=self.count, content_block=block))
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.count, delta=delta)

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]


async def _message_events(
    call: InferenceCall, started: Started, maker: _MessageMaker, record: CallRecord
) -> AsyncIterator[str]:
    """message_start, ping, the content blocks (thinking, text, tool_use) with their deltas,
    message_delta (stop_reason, usage), message_stop. Closing the connection cancels this
    generator; leaving `async with call` aborts the request."""
    blocks = _Blocks()
    async with call:
        try:
            shell = {"input_tokens": started.prompt_tokens or 0, "output_tokens": 0}
            yield _event("message_start", message=maker.message([], None, shell))
            yield _event("ping")
            async for event in call.events():
                if isinstance(event, Reasoning) and event.text:
                    if blocks.open != "thinking":
                        for line in blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield line
                    yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
                elif isinstance(event, Delta) and event.text:
                    if blocks.open != "text":
                        for line in blocks.start("text", {"type": "text", "text": ""}):
                            yield line
                    yield blocks.delta({"type": "text_delta", "text": event.text})
                elif isinstance(event, Done):
                    record_stats(event)
                    for line in _tool_blocks(blocks, event):
                        yield line
                    for line in blocks.stop():
                        yield line
                    delta = {"stop_reason": stop_reason(event), "stop_sequence": event.stop_sequence}
                    yield _event(
                        "message_delta", delta=delta, usage=usage_of(event.usage), hypnos_telemetry=event.telemetry
                    )
                    yield _event("message_stop")
        except HypnosError as error:
            # An error event, or the transport failed (a lost reply, a vanished worker).
            yield anthropic_sse_error(error, record)


def _tool_blocks(blocks: _Blocks, done: Done) -> list[str]:
    """Each tool call as a tool_use block, its input whole in one input_json_delta."""
    events: list[str] = []
    for call in done.tool_calls:
        block = tool_use(call)
        events += blocks.start("tool_use", {**block, "input": {}})
        events.append(blocks.delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
    return events
