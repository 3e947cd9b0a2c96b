"""Tool calls in model output, and the JSON schemas that force one.

Small models rarely keep to their template's call format: Qwen2.5-Coder, asked for
`<tool_call>{...}</tool_call>`, answers with a fenced JSON object or a bare one as often as not.
The parser accepts all three, but only objects whose `name` is one of the declared tools, so an
answer that merely contains JSON stays an answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCED = re.compile(r"```(?:json|tool_call)?\s*(.*?)```", re.S)
# What an answer that is a call starts with; while the output could still become one of these,
# a streaming response holds it back.
CALL_OPENERS = ("<tool_call>", "```", "{", "[")


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def as_openai(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def _objects(text: str) -> list[tuple[int, int, Any]]:
    """Every JSON value that starts with { or [ in `text`, as (start, end, value)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i += 1
                continue
            found.append((i, end, value))
            i = end
        else:
            i += 1
    return found


def _as_call(value: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split model output into the answer text and the calls of declared tools it makes."""
    for pattern in (_TAGGED, _FENCED):
        spans = [(m.start(), m.end(), m.group(1)) for m in pattern.finditer(text)]
        calls = [c for _, _, body in spans for c in _calls_in(body, names)]
        if calls:
            return _without(text, [(s, e) for s, e, _ in spans]), calls
    found_spans: list[tuple[int, int]] = []
    calls = []
    for start, end, value in _objects(text):
        found = _calls_in_value(value, names)
        if found:
            found_spans.append((start, end))
            calls += found
    return (_without(text, found_spans), calls) if calls else (text, [])


def _calls_in(body: str, names: set[str]) -> list[ToolCall]:
    return [c for _, _, value in _objects(body) for c in _calls_in_value(value, names)]


def _calls_in_value(value: Any, names: set[str]) -> list[ToolCall]:
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(item, names) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    kept, last = [], 0
    for start, end in sorted(spans):
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    return "".join(kept).strip()


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A JSON schema that only a call of one of `tools` satisfies (for grammar decoding). Each
    tool's local references ("#/$defs/x") are rebased onto where its parameters now stand."""
    options = []
    for index, tool in enumerate(tools):
        at = "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{index}/properties/arguments"
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": _rebased(tool["function"].get("parameters") or {"type": "object"}, at),
                },
                "required": ["name", "arguments"],
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_tools(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    """The tools a forced call may pick: the named one, else ("required") all of them."""
    named = [t for t in tools if isinstance(choice, dict) and t["function"]["name"] == choice.get("name")]
    return named or tools


def _rebased(schema: Any, at: str) -> Any:
    """A copy of `schema` whose "#/..." references point below `at` instead of its own root."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {key: _rebased(value, at) for key, value in schema.items()}
    ref = copy.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        copy["$ref"] = at + ref[1:]
    return copy


def may_become_call(text: str) -> bool:
    """Whether streamed output seen so far could still turn out to be a call."""
    stripped = text.lstrip()
    return any(opener.startswith(stripped) or stripped.startswith(opener) for opener in CALL_OPENERS)
