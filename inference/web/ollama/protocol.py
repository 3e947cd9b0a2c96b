"""Wire models of the Ollama API (issue 17), named like Ollama's own request types; the serving
code maps them onto the same typed work as /v1 (inference/web/ollama/serving.py)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hypnos_site.errors import InvalidRequest
from inference.web.common.protocol import Tool, input_texts

# Go's time.ParseDuration units, as Ollama reads a keep_alive string ("5m", "1h30m", "300ms").
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
# Go's longest time.Duration, 2**63 - 1 nanoseconds (ollama_models.FOREVER).
MAX_DURATION_SECS = (2**63 - 1) / 1e9


class _Wire(BaseModel):
    # Unknown fields are ignored (Ollama ignores them too); a wrong JSON type is a 400.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # Go clients leave a field out; JavaScript ones send null: both mean the default.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Named(_Wire):
    """A body that names a model: `model`, or `name` as Ollama's older clients send it."""

    model: str = Field(default="", max_length=512)
    name: str | None = None

    @model_validator(mode="after")
    def _model_or_name(self) -> _Named:
        if not self.model and self.name:
            self.model = self.name
        if not self.model:
            raise ValueError("model is required")
        return self


class Options(_Wire):
    """The `options` Hypnos applies; load-time and sampler options it has no equivalent for
    (num_gpu, num_thread, mirostat, ...) are ignored, as Ollama ignores unknown ones."""

    num_ctx: int | None = Field(default=None, ge=1)
    # -1: until the model stops (within limits.max_tokens_cap); -2: fill the context (the same here).
    num_predict: int | None = Field(default=None, ge=-2)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = Field(default=None, ge=1, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else self.stop

    def max_tokens(self) -> int | None:
        """num_predict as a token budget; None (the model's default, capped) when it sets none."""
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 else None


class ToolCallFunction(_Wire):
    name: str
    # Ollama sends (and answers) the arguments as an object, not OpenAI's JSON string.
    arguments: dict[str, Any] = {}


class ToolCall(_Wire):
    id: str | None = None
    function: ToolCallFunction


class Message(_Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    # Base64 image data (no data: prefix), for vision models.
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    # The tool whose answer a role "tool" message carries.
    tool_name: str | None = None


Think = bool | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = str | int | float


class _KeptAlive(_Named):
    """A request that names how long its model stays loaded after it."""

    keep_alive: KeepAlive | None = None

    def keep_alive_secs(self) -> float | None:
        """keep_alive in seconds (negative: forever); None when the request sets none."""
        return None if self.keep_alive is None else duration_secs(self.keep_alive)


class _Generating(_KeptAlive):
    """What chat and generate share."""

    format: Format | None = None
    options: Options = Options()
    stream: bool = True
    think: Think | None = None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the answer must match: {} for `format: "json"` (any JSON value), the
        object itself for a JSON schema, None for free text."""
        if self.format is None or self.format == "":
            return None
        return {} if self.format == "json" else self.format


class ChatRequest(_Generating):
    messages: list[Message] = []
    tools: list[Tool] | None = None


class GenerateRequest(_Generating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(_KeptAlive):
    input: str | list[str]
    truncate: bool = True
    options: Options = Options()
    dimensions: int | None = Field(default=None, ge=1)

    def texts(self) -> list[str]:
        return input_texts(self.input)


class EmbeddingsRequest(_KeptAlive):
    prompt: str = Field(min_length=1)
    options: Options = Options()


class ShowRequest(_Named):
    verbose: bool = False


class PullRequest(_Named):
    insecure: bool = False
    stream: bool = True


class DeleteRequest(_Named):
    pass


def duration_secs(value: KeepAlive) -> float:
    """A keep_alive as Ollama reads it: a number of seconds, or a Go duration string ("5m",
    "1h30m", "-1s"); a bare number in a string counts seconds too. 400 for anything else, and
    for a duration past Go's longest (about 292 years): the model's expiry would have no date,
    and the worker's status, which shows it, could not be read while it held."""
    secs = _seconds(value)
    if math.isnan(secs) or secs > MAX_DURATION_SECS:
        raise InvalidRequest(
            f"keep_alive {str(value)[:40]!r} is beyond the longest duration (about 292 years); "
            "-1 keeps the model loaded for good",
            param="keep_alive",
        )
    return secs


def _seconds(value: KeepAlive) -> float:
    if isinstance(value, bool):
        raise InvalidRequest('keep_alive must be a duration such as "5m" or a number of seconds', param="keep_alive")
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            return math.inf if value > 0 else -math.inf
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise InvalidRequest(
            f'keep_alive {value!r} is not a duration such as "5m", "1h30m" or a number of seconds',
            param="keep_alive",
        )
    return sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
