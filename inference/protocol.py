"""Wire models of the OpenAI-compatible API, named like OpenAI's (vLLM's `protocol` split)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference.errors import InvalidRequest


class _Wire(BaseModel):
    # Unknown fields are ignored (spec §1); a wrong JSON type is a 400, not a coercion (compat.md).
    model_config = ConfigDict(extra="ignore", strict=True)


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

    def media_kinds(self) -> set[str]:
        if not isinstance(self.content, list):
            return set()
        return {part.type for part in self.content if not isinstance(part, TextPart)}


class StreamOptions(_Wire):
    include_usage: bool | None = None


class ChatCompletionRequest(_Wire):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    ctx_size: int | None = Field(default=None, ge=1)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4:
            raise InvalidRequest("stop takes at most 4 strings", param="stop")
        return stops


class MemoryTierRequest(_Wire):
    model: str = Field(min_length=1)
    target_tier: Literal["tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"]
    context_len: int | None = Field(default=None, ge=256)


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], data: Any) -> M:
    """Validate a request body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union["))]
        param = ".".join(loc) or None
        raise InvalidRequest(f"Invalid value for {param or 'the body'}: {err['msg']}", param=param) from exc
