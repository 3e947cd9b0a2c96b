"""Wire models of the OpenAI-compatible API, named like OpenAI's (vLLM's `protocol` split)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from hypnos_site.config import MAX_CONTEXT_LEN
from hypnos_site.errors import InvalidRequest
from inference.transport.wire import IMAGE_MARKER
from inference.web.common.protocol import THINKING_BUDGETS, Tool, _Wire
from models_registry.advisor import Need


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ImageUrl(_Wire):
    url: str
    detail: str | None = None


class ImageUrlPart(_Wire):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Wire):
    data: str
    format: str = "wav"


class InputAudioPart(_Wire):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImageUrlPart | InputAudioPart, Field(discriminator="type")]


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def text_with_images(self) -> str:
        """The text, each image part as IMAGE_MARKER where it stood (a marker typed in the
        text itself is removed, so markers and images always pair up)."""
        if not isinstance(self.content, list):
            return self.text().replace(IMAGE_MARKER, "")
        return "".join(
            part.text.replace(IMAGE_MARKER, "") if isinstance(part, TextPart) else IMAGE_MARKER
            for part in self.content
            if isinstance(part, TextPart | ImageUrlPart)
        )

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageUrlPart)]

    def media_kinds(self) -> set[str]:
        if not isinstance(self.content, list):
            return set()
        return {part.type for part in self.content if not isinstance(part, TextPart)}


class StreamOptions(_Wire):
    include_usage: bool | None = None


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Wire):
    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's server and llama-cpp-python take the schema here for json_object too.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema the output must match; {} for any JSON object; None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequest("response_format json_schema needs a json_schema object", param="response_format")
            return self.json_schema.schema_ or {}
        return self.schema_ or {}


class SamplingFields(_Wire):
    """What chat and completions share (compat.md)."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repeat_penalty: float = Field(default=1.0, ge=1, le=2)
    num_ctx: int | None = Field(default=None, ge=1)
    ctx_size: int | None = Field(default=None, ge=1)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4:
            raise InvalidRequest("stop takes at most 4 strings", param="stop")
        return stops


class ChatCompletionRequest(SamplingFields):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Thinking (spec §7.1): accepted; models without a thinking format ignore it.
    think: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    enable_thinking: bool | None = None
    thinking: bool | None = None

    def thinking_request(self) -> tuple[bool, int | None]:
        """(thinking on, thought-token budget or None): reasoning_effort wins over think, and
        think over the compat.md aliases (enable_thinking / thinking: false = "none", true = think)."""
        effort = self.reasoning_effort
        if effort is None:
            alias = self.enable_thinking if self.enable_thinking is not None else self.thinking
            if self.think is None and alias is False:
                effort = "none"
            else:
                return bool(self.think if self.think is not None else alias), None
        if effort == "none":
            return False, None
        return True, THINKING_BUDGETS[effort]

    def tool_choice_value(self) -> str | dict[str, str]:
        """ "auto" | "none" | "required" | {"name": ...}, checked against `tools`."""
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if choice.function.name not in names:
                raise InvalidRequest(
                    f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
                )
            return {"name": choice.function.name}
        if choice == "required" and not self.tools:
            raise InvalidRequest("tool_choice is required but no tools were sent", param="tool_choice")
        return choice


class CompletionRequest(SamplingFields):
    model: str = Field(min_length=1)
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidRequest("prompt as an array takes exactly one string here", param="prompt")
        return self.prompt[0]


class ResponsesTool(_Wire):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesTextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponsesText(_Wire):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Wire):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(_Wire):
    """OpenAI's Responses API, stateless (compat.md): no stored responses, no previous_response_id."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    text: ResponsesText | None = None
    stream: bool = False
    seed: int | None = None
    # Thinking as chat's reasoning_effort (spec §7.1); the thoughts come back as a reasoning item.
    reasoning: ResponsesReasoning | None = None

    def thinking_request(self) -> tuple[bool, int | None]:
        effort = self.reasoning.effort if self.reasoning else None
        if effort is None or effort == "none":
            return False, None
        return True, THINKING_BUDGETS[effort]


class KvParkRequest(_Wire):
    enabled: bool | None = None
    max_bytes: int | None = Field(default=None, ge=0)


class MoeOffloadRequest(_Wire):
    # Checked by the worker: an unknown mode is 422, not 400 (spec §6).
    mode: str


class InternalSetRequest(_Wire):
    max_loaded_models: int | None = Field(ge=1)


class MemoryTierRequest(_Wire):
    model: str = Field(min_length=1)
    target_tier: Literal["tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"]
    context_len: int | None = Field(default=None, ge=256, le=MAX_CONTEXT_LEN)
    # Several inference workers: the one (server.worker_id) to move it on; unset, the one that
    # holds it (a promotion: where a request would be routed).
    worker: str | None = Field(default=None, min_length=1, max_length=64)


class AdvisorRequest(_Wire):
    """POST /v1/advisor (spec §6); the machine fields left out are this server's."""

    needs: list[Need] = Field(min_length=1)
    vram_bytes: int | None = Field(default=None, ge=0)
    ram_bytes: int | None = Field(default=None, ge=1)
    unified_memory: bool | None = None


class BatchCreateRequest(_Wire):
    """POST /v1/batches (OpenAI's Batch API)."""

    input_file_id: str = Field(min_length=1, max_length=100)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)

    @field_validator("metadata")
    @classmethod
    def _keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and any(len(key) > 64 for key in value):
            raise ValueError("a metadata key is at most 64 characters")
        return value
