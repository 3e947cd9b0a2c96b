"""POST /v1/responses (compat.md): OpenAI's Responses API over the chat engine, stateless."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.config import ModelConfig
from hypnos_site.errors import HypnosError, InvalidRequest
from inference.transport.client import InferenceCall, InferenceClient
from inference.transport.deadline import within
from inference.transport.wire import Delta, Done, GenerateWork, Reasoning, Usage
from inference.web.common.context import RequestContext, resolve_model, start_call, with_wait_estimate
from inference.web.common.generation import capped_max_tokens, check_grammars, model_defaults, record_stats
from inference.web.common.render import error_fields, sse_response
from inference.web.openai.protocol import ResponsesRequest
from inference.web.openai.serving_chat import check_prompt_chars, request_timed_out
from logs.record import CallRecord


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        )
    raise InvalidRequest("a message's content must be a string or a list of text parts", param="input")


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Responses input items as chat messages (function calls and their outputs included)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"input message role {role!r} is not supported", param="input")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"))}
            )
        elif kind == "function_call":
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": item.get("call_id"),
                            "type": "function",
                            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
                        }
                    ],
                }
            )
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))}
            )
        else:
            raise InvalidRequest(f"input item type {kind!r} is not supported", param="input")
    if not messages:
        raise InvalidRequest("input is empty", param="input")
    return messages


def responses_work(body: ResponsesRequest, model: ModelConfig) -> GenerateWork:
    messages = input_messages(body)
    check_prompt_chars(sum(len(m["content"]) for m in messages), "input")
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in body.tools or []
    ]
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, dict):
        choice = {"name": choice.get("name")}
    fmt = body.text.format if body.text and body.text.format else None
    schema = None if fmt is None or fmt.type == "text" else (fmt.schema_ or {})
    check_grammars(schema, "text.format", tools, choice)
    think, budget = body.thinking_request()
    return GenerateWork(
        messages=messages,
        max_tokens=capped_max_tokens(body.max_output_tokens, model),
        **model_defaults(body, model, "temperature", "top_p"),
        seed=body.seed,
        tools=tools or None,
        tool_choice=choice,
        json_schema=schema,
        schema_param="text.format",
        prompt_param="input",
        think=think,
        thinking_budget=budget,
    )


class _Builder:
    """The response object and its output items, shared by the JSON and the streamed forms."""

    def __init__(self, body: ResponsesRequest):
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.body = body
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], done: Done | None = None) -> dict[str, Any]:
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.body.model,
            "output": output,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature,
            "tools": [t.model_dump(by_alias=True) for t in self.body.tools or []],
            "parallel_tool_calls": False,
            "error": None,
            "incomplete_details": None,
        }
        if done is not None:
            usage = done.usage or Usage()
            response["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
            response["hypnos_telemetry"] = done.telemetry
            if done.finish_reason == "length":
                response["status"] = "incomplete"
                response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
        }

    @staticmethod
    def function_call(call: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "fc_" + call["id"].removeprefix("call_"),
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }

    def output(self, text: str, done: Done, reasoning: str = "") -> list[dict[str, Any]]:
        items = [self.message(text)] if text or not done.tool_calls else []
        if reasoning:
            # The thoughts first, as OpenAI's reasoning item (they come before the answer).
            items.insert(0, self.reasoning(reasoning))
        return items + [self.function_call(c) for c in done.tool_calls]

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [], "content": content}


async def create_response(client: InferenceClient, body: ResponsesRequest, ctx: RequestContext) -> HttpResponseBase:
    model = await resolve_model(client, body.model, ctx)
    work = responses_work(body, model)
    timeout = settings.HYPNOS.limits.request_timeout_secs
    builder = _Builder(body)
    try:
        call, _ = await within(start_call(client, model, work, ctx), timeout)
        if body.stream:
            return with_wait_estimate(sse_response(_response_events(call, builder, ctx.record)), call)
        drained = await within(call.drain(), timeout)
    except TimeoutError:
        return request_timed_out(timeout)
    record_stats(drained.done)
    response = builder.response(
        "completed", builder.output(drained.text, drained.done, drained.reasoning), drained.done
    )
    response["output_text"] = drained.text
    return with_wait_estimate(JsonResponse(response), call)


async def _response_events(call: InferenceCall, builder: _Builder, record: CallRecord) -> AsyncIterator[str]:
    """The named SSE events of the Responses API, ending with response.completed."""
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        payload = json.dumps({"type": kind, "sequence_number": seq - 1, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {payload}\n\n"

    text: list[str] = []
    thoughts: list[str] = []
    thinking = False
    ids = {"item_id": builder.message_id, "output_index": 0, "content_index": 0}
    opened = False

    def close_reasoning() -> Iterator[str]:
        """The reasoning item ends where the answer (or the response) begins."""
        nonlocal thinking
        thinking = False
        whole = "".join(thoughts)
        reasoning = {"item_id": builder.reasoning_id, "output_index": 0, "content_index": 0}
        yield event("response.reasoning_text.done", **reasoning, text=whole)
        yield event("response.output_item.done", output_index=0, item=builder.reasoning(whole))

    async with call:
        try:
            yield event("response.created", response=builder.response("in_progress", []))
            yield event("response.in_progress", response=builder.response("in_progress", []))
            async for item in call.events():
                if isinstance(item, Reasoning) and item.text:
                    if not thoughts:
                        thinking = True
                        yield event(
                            "response.output_item.added", output_index=0, item=builder.reasoning("", "in_progress")
                        )
                    thoughts.append(item.text)
                    yield event(
                        "response.reasoning_text.delta",
                        item_id=builder.reasoning_id,
                        output_index=0,
                        content_index=0,
                        delta=item.text,
                    )
                elif isinstance(item, Delta) and item.text:
                    if thinking:
                        for line in close_reasoning():
                            yield line
                    if not opened:
                        opened = True
                        ids["output_index"] = 1 if thoughts else 0
                        yield event(
                            "response.output_item.added",
                            output_index=ids["output_index"],
                            item=builder.message("", "in_progress"),
                        )
                        yield event(
                            "response.content_part.added",
                            **ids,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    text.append(item.text)
                    yield event("response.output_text.delta", **ids, delta=item.text)
                elif isinstance(item, Done):
                    record_stats(item)
                    if thinking:
                        for line in close_reasoning():
                            yield line
                    whole = "".join(text)
                    index = 1 if thoughts else 0
                    if opened:
                        part = {"type": "output_text", "text": whole, "annotations": []}
                        yield event("response.output_text.done", **ids, text=whole)
                        yield event("response.content_part.done", **ids, part=part)
                        yield event(
                            "response.output_item.done", output_index=ids["output_index"], item=builder.message(whole)
                        )
                        index += 1
                    for offset, tool_call in enumerate(item.tool_calls):
                        fc = builder.function_call(tool_call)
                        yield event(
                            "response.output_item.added",
                            output_index=index + offset,
                            item={**fc, "arguments": "", "status": "in_progress"},
                        )
                        yield event(
                            "response.function_call_arguments.delta",
                            item_id=fc["id"],
                            output_index=index + offset,
                            delta=fc["arguments"],
                        )
                        yield event(
                            "response.function_call_arguments.done",
                            item_id=fc["id"],
                            output_index=index + offset,
                            arguments=fc["arguments"],
                        )
                        yield event("response.output_item.done", output_index=index + offset, item=fc)
                    final = builder.response("completed", builder.output(whole, item, "".join(thoughts)), item)
                    yield event("response.completed", response=final)
        except HypnosError as error:
            # The Responses API's own failure event; the envelope's fields under `error`.
            record.note_error(error.message, error.type)
            failed = builder.response("failed", [])
            failed["error"] = {**error_fields(error), "code": error.code or error.type}
            yield event("response.failed", response=failed)
