"""Wire models of Anthropic's Messages API (issue 17), named like the `anthropic` SDK's params.

Unknown fields are ignored, as on the OpenAI routes (`cache_control`, `service_tier`, ...); an
unknown content block, tool or tool_choice type is a 400 naming where it stood.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from inference.web.common.protocol import _Wire


class TextBlockParam(_Wire):
    type: Literal["text"]
    text: str


class Base64ImageSource(_Wire):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(_Wire):
    type: Literal["url"]
    url: str


class ImageBlockParam(_Wire):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]

    def url(self) -> str:
        """The image as the chat route's loader takes it: a data: URL, or the http(s) URL."""
        if isinstance(self.source, Base64ImageSource):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class ToolUseBlockParam(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlockParam(_Wire):
    """Thoughts of an earlier assistant turn, sent back; the chat templates take none, so they
    are left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(_Wire):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(_Wire):
    role: Literal["user", "assistant"]
    content: list[ContentBlockParam]

    @model_validator(mode="before")
    @classmethod
    def _string_is_one_text_block(cls, data: Any) -> Any:
        """A string content is shorthand for one text block (Anthropic's own rule); read so,
        a wrong block is named where it stands instead of as "not a string"."""
        if isinstance(data, dict) and isinstance(data.get("content"), str):
            return {**data, "content": [{"type": "text", "text": data["content"]}]}
        return data


class ToolParam(_Wire):
    """A client tool; Anthropic's server tools (web search, code execution, ...) are not served."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(_Wire):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Wire):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Wire):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Wire):
    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingConfigEnabled(_Wire):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingConfigAdaptive(_Wire):
    type: Literal["adaptive"]


class ThinkingConfigDisabled(_Wire):
    type: Literal["disabled"]


ThinkingConfigParam = Annotated[
    ThinkingConfigEnabled | ThinkingConfigAdaptive | ThinkingConfigDisabled, Field(discriminator="type")
]


class JSONOutputFormatParam(_Wire):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Wire):
    """Structured outputs: the answer's text matches `format`'s schema (a grammar enforces it).
    `effort` is not read."""

    format: JSONOutputFormatParam | None = None


class MetadataParam(_Wire):
    user_id: str | None = None


class MessageCountTokensParams(_Wire):
    """POST /v1/messages/count_tokens: what shapes the prompt, nothing that samples."""

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfigParam | None = None
    output_config: OutputConfigParam | None = None


class MessageCreateParams(MessageCountTokensParams):
    """POST /v1/messages. `max_tokens` is required, as Anthropic requires it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: MetadataParam | None = None
    stream: bool = False
