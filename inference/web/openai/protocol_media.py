"""Wire models of the embeddings and audio routes, named like OpenAI's (spec §8-§10, compat.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from hypnos_site.errors import InvalidRequest
from inference.web.common.protocol import _Wire, input_texts

# What /v1/audio/speech answers in; compat.md: all really encoded, anything else is a 400.
SPEECH_FORMATS = ("wav", "pcm", "mp3", "opus", "aac", "flac")
TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# An entity label is a short phrase ("person", "date of birth").
MAX_LABEL_CHARS = 100


def input_token_ids(value: list[list[int]]) -> list[list[int]]:
    """Token-id arrays of an embedding request, refused when there are none, one is empty or
    holds a negative id (the worker checks the top of the model's vocabulary)."""
    if not value:
        raise InvalidRequest("input must not be empty", param="input")
    for index, ids in enumerate(value):
        if not ids:
            raise InvalidRequest(f"input[{index}] is an empty array of token ids", param="input")
        if min(ids) < 0:
            raise InvalidRequest(f"input[{index}] holds the negative token id {min(ids)}", param="input")
    return value


def _is_token_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


class EmbeddingRequest(_Wire):
    """POST /v1/embeddings. `input` takes OpenAI's four shapes: a string, an array of strings,
    an array of token ids, an array of arrays of token ids (what LangChain's OpenAIEmbeddings
    sends by default). Token ids are the served model's own, as vLLM and llama.cpp's server
    read them."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_shape(cls, value: Any) -> Any:
        # One message naming `input`, not four (one per shape of the union, each named by its type).
        if isinstance(value, str) or value == []:
            return value
        if isinstance(value, list):
            if all(isinstance(item, str) for item in value) or all(_is_token_id(item) for item in value):
                return value
            if all(isinstance(item, list) for item in value):
                for index, ids in enumerate(value):
                    if not all(_is_token_id(item) for item in ids):
                        raise ValueError(f"input[{index}] must be an array of token ids (integers)")
                return value
            raise ValueError(
                "input is an array of strings, of token ids (integers) or of arrays of token ids, "
                "not an array mixing them"
            )
        raise ValueError(
            "input must be a string, an array of strings, an array of token ids (integers) or an "
            "array of arrays of token ids"
        )

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list of texts or of token-id arrays; 400 naming `input` when empty."""
        if isinstance(self.input, str):
            return input_texts(self.input)
        # One shape per array (_one_shape): at most one of these holds anything.
        texts = [item for item in self.input if isinstance(item, str)]
        ids = [item for item in self.input if isinstance(item, int)]
        arrays = [item for item in self.input if isinstance(item, list)]
        if ids:
            return input_token_ids([ids])
        return input_token_ids(arrays) if arrays else input_texts(texts)


class EntityRequest(_Wire):
    """POST /v1/entities (spec §13). `flat` unset: the model's default, flat spans."""

    model: str = Field(min_length=1)
    input: str | list[str]
    labels: list[str]
    threshold: float = Field(default=0.5, ge=0, le=1)
    flat: bool = True

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not texts:
            raise InvalidRequest("input must hold at least one text", param="input")
        return texts

    def checked_labels(self, max_labels: int) -> list[str]:
        """The labels as given, 400 naming `labels` when there are none, too many, an empty or
        overlong one, a control character, or the same label twice."""
        if not self.labels:
            raise InvalidRequest("labels must name at least one entity type", param="labels")
        if len(self.labels) > max_labels:
            raise InvalidRequest(
                f"labels holds {len(self.labels)} labels; at most {max_labels} are allowed (limits.max_entity_labels).",
                param="labels",
            )
        seen: set[str] = set()
        for index, label in enumerate(self.labels):
            if not label.strip():
                raise InvalidRequest(f"labels[{index}] is empty", param="labels")
            if len(label) > MAX_LABEL_CHARS:
                raise InvalidRequest(f"labels[{index}] is longer than {MAX_LABEL_CHARS} characters", param="labels")
            if any(ord(c) < 32 or ord(c) == 127 for c in label):
                raise InvalidRequest(f"labels[{index}] holds a control character", param="labels")
            if label in seen:
                raise InvalidRequest(f"labels[{index}] repeats the label {label!r}", param="labels")
            seen.add(label)
        return list(self.labels)


# data[].seed is the request's seed plus the image's index: both fit stable-diffusion.cpp's int64.
MAX_SEED = 2**62


class ImageGenerationRequest(_Wire):
    """POST /v1/images/generations (spec §11); also the fields of edits and variations once
    their form is read. `quality`, `style` and `user` are ignored (unknown fields are)."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    n: int = Field(default=1, ge=1)
    # WIDTHxHEIGHT, or "auto" / unset for the model's default.
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    steps: int | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    cfg_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def dimensions(self) -> tuple[int, int] | None:
        """(width, height) as asked, None for the model's default; 400 naming `size` otherwise."""
        if self.size is None or self.size == "auto":
            return None
        width, x, height = self.size.lower().partition("x")
        if not x or not (width.isdigit() and height.isdigit()) or len(width) > 6 or len(height) > 6:
            raise InvalidRequest(f"size must be WIDTHxHEIGHT (e.g. 1024x1024), not {self.size!r}.", param="size")
        if int(width) < 1 or int(height) < 1:
            raise InvalidRequest(f"size {self.size!r} has a side of 0 pixels.", param="size")
        return int(width), int(height)


class ImageUpscaleRequest(_Wire):
    """POST /v1/images/upscale (compat.md, Lemonade's route): a base64 PNG (or a data: URI)."""

    model: str = Field(min_length=1)
    image: str = Field(min_length=1)
    upscale_factor: int | None = Field(default=None, ge=1)


class SpeechRequest(_Wire):
    model: str = Field(min_length=1)
    input: str = Field(min_length=1)
    voice: str = "alloy"
    response_format: str = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream: bool = False
    # OpenAI's stream_format: "audio" streams the bytes (as stream: true does), "sse" streams
    # speech.audio.delta events with base64 audio, then speech.audio.done.
    stream_format: Literal["audio", "sse"] | None = None
    # Hypnos extension: the language of input; None: the voice's own.
    language: str | None = Field(
        default=None, min_length=2, max_length=35, pattern=r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8})*$"
    )
    instructions: str | None = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value not in SPEECH_FORMATS:
            raise ValueError(f"must be one of {', '.join(SPEECH_FORMATS)}")
        return value

    @field_validator("input")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        # The phonemizers (espeak-ng under Piper and Kokoro) take C strings, which end at a NUL:
        # dropping it silently would speak a text the client did not send, so it is refused.
        if "\x00" in value:
            raise ValueError(f"must not contain NUL characters (U+0000; the first at index {value.index(chr(0))})")
        return value


class TranscriptionRequest(_Wire):
    """The fields of POST /v1/audio/transcriptions once the upload is read (multipart or JSON)."""

    model: str = Field(min_length=1)
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = Field(default=0.0, ge=0, le=1)
    timestamp_granularities: list[Literal["word", "segment"]] = []
    filename: str | None = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value not in TRANSCRIPTION_FORMATS:
            raise ValueError(f"must be one of {', '.join(TRANSCRIPTION_FORMATS)}")
        return value


# Multipart booleans (spec §12): what a form field may say for true and for false.
FORM_TRUE = ("true", "1", "yes", "on")
FORM_FALSE = ("false", "0", "no", "off")


class DocumentConvertRequest(_Wire):
    """POST /v1/documents/convert (spec §12), its JSON fields or multipart parts; `file` here
    is the JSON form (base64 or a data: URI), an uploaded part is taken apart."""

    model: str = Field(min_length=1)
    file: str | None = None
    url: str | None = None
    filename: str | None = Field(default=None, max_length=255)
    pages: str | None = Field(default=None, max_length=32)
    ocr: bool = True
    output_format: Literal["markdown", "json"] = "markdown"
    stream: bool = False
    describe_pictures: str | None = None
    return_pictures: bool = False

    @field_validator("filename")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        # Only a name: it names the format and the response, never a path on this machine.
        if value is not None and ("\x00" in value or "/" in value or "\\" in value):
            raise ValueError("must be a file name, without a path or NUL characters")
        return value


class FileUploadRequest(_Wire):
    """POST /v1/files: the form's fields beside its `file` part (what the OpenAI SDKs send)."""

    purpose: str = Field(description='What the file is for: "batch", a Batch API input (JSONL, one request a line).')
