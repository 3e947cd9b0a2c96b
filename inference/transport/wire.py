"""The typed messages between the web process and the inference worker (vLLM's engine-client
split: `EngineRequest` in, `EngineEvent`s out).

Everything that crosses between web and worker is one of these: an `EngineRequest` carrying the
work of one modality, a `ControlRequest` carrying one control operation, and the events the
worker answers with. The in-process transport hands the objects over as they are; the channel
layer carries `encode_*` output and rebuilds the objects with `decode_*` (the one serialiser).

Events are slotted dataclasses, not pydantic models, because a streamed chat makes one per
token: building one costs a few hundred nanoseconds, while the channel layer's validation (a
pydantic TypeAdapter over the discriminated union) runs only where messages leave the process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from hypnos_site.errors import HypnosError, ServerError
from inference.transport.entities import Span
from inference.transport.transcripts import Transcript

# -- work ------------------------------------------------------------------------------------


class _Work(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


class GenerateWork(_Work):
    """Chat and completions (and /v1/responses, Anthropic's and Ollama's routes); the worker
    runs it as the engine's ChatWork, which adds what the engine prepared."""

    kind: Literal["chat"] = "chat"
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = []
    num_ctx: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    # OpenAI tool objects and "auto" | "none" | "required" | {"name": ...}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    # A JSON schema the output must match ({} for any JSON object), enforced with a grammar.
    json_schema: dict[str, Any] | None = None
    # Log probabilities of each sampled token, with this many alternatives (None: off).
    top_logprobs: int | None = None
    # /v1/completions: the prompt as given, no chat template.
    raw_prompt: str | None = None
    # The encoded images of the messages' image parts, in the order of their IMAGE_MARKERs.
    images: list[bytes] = []
    # Thinking on (spec §7.1) and its thought-token budget (None: bounded by max_tokens only).
    think: bool = False
    thinking_budget: int | None = None
    # The request fields an error about the prompt or the JSON schema names (the routes differ).
    prompt_param: str = "messages"
    schema_param: str = "response_format"
    # POST /v1/messages/count_tokens: render and tokenise the prompt exactly as a generation
    # would, answer its token count in Done.usage, generate nothing.
    count_only: bool = False


class EmbedWork(_Work):
    """Texts, or token-id arrays of the model's own vocabulary (evaluated as given: no special
    tokens added)."""

    kind: Literal["embed"] = "embed"
    input: list[str] | list[list[int]]


class TranscribeWork(_Work):
    """A transcription: the audio inline (base64) or as a spool file the worker reads and removes."""

    kind: Literal["transcribe"] = "transcribe"
    audio: str | None = None
    audio_path: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    max_audio_secs: float | None = None
    audio_param: str = "file"


class SpeechWork(_Work):
    kind: Literal["speech"] = "speech"
    input: str
    voice: str
    speed: float = 1.0
    response_format: str = "wav"
    stream: bool = False
    # ISO 639-1 (or a tag such as en-GB); None: the voice's own. The worker resolves it before
    # the request starts (Engine.speech_language) and refuses one the voice cannot speak.
    language: str | None = None


class ImageWork(_Work):
    """Image generation, edits, variations and upscaling (spec §11). The references are spool
    files the worker reads and removes; each finished image is a PNG in `output_dir`, which
    its job removes (an image can exceed what one channel-layer message carries)."""

    kind: Literal["image"] = "image"
    op: Literal["generate", "edit", "variation", "upscale"] = "generate"
    prompt: str = ""
    negative_prompt: str = ""
    n: int = 1
    # As asked (None: the model's default size); the worker clamps and rounds it, or refuses
    # it for a generator of one size.
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    cfg_scale: float | None = None
    seed: int = 0
    reference_paths: list[str] = []
    upscale_factor: int | None = None
    output_dir: str
    # limits.max_image_pixels of the web process that took the request: the largest reference
    # the worker decodes and the largest image an upscale may make (one cap, the web's).
    max_pixels: int


class DocumentWork(_Work):
    """A document conversion (spec §12): the upload as a spool file the job removes, the pages
    asked for, and where the worker writes the pictures' PNGs when they are wanted."""

    kind: Literal["document"] = "document"
    path: str
    filename: str | None = None
    # "3", "2-5"; None: every page. Checked against the page count before `started`.
    pages: str | None = None
    ocr: bool = True
    want_json: bool = False
    picture_dir: str | None = None
    # limits.max_document_pages of the web process that took the upload.
    max_pages: int


class EntityWork(_Work):
    """Zero-shot entity extraction (spec §13): the texts, the labels, and how spans are kept."""

    kind: Literal["entities"] = "entities"
    input: list[str]
    labels: list[str]
    threshold: float = 0.5
    flat: bool = True


Work = Annotated[
    GenerateWork | EmbedWork | TranscribeWork | SpeechWork | ImageWork | DocumentWork | EntityWork,
    Field(discriminator="kind"),
]
MediaWorkKind = Literal["embed", "transcribe", "speech"]


class EngineRequest(_Work):
    """One inference request: the model it names, its work, and its scheduling hints."""

    type: Literal["engine"] = "engine"
    request_id: str
    model: str
    work: Work
    # x-hypnos-deadline-ms: the longest the request may wait before it starts.
    deadline_ms: float | None = None
    # x-hypnos-next-model: the model to bring up meanwhile.
    next_model: str | None = None
    # x-hypnos-priority: background (a batch's lines): it takes a slot of its model only while
    # no other request waits for one.
    background: bool = False

    @property
    def op(self) -> str:
        return self.work.kind


ControlOp = Literal[
    "status",
    "memory_status",
    "move",
    "set_limits",
    "kv_park",
    "enable",
    "disable",
    "moe_offload",
    "keep_alive",
    "fault",
    "add_model",
    "replace_model",
    "remove_model",
    "update_model",
]


class NoArgs(_Work):
    pass


class ModelArgs(_Work):
    """enable, disable: the model they act on."""

    model: str


class MoveArgs(ModelArgs):
    target_tier: Literal["tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"]
    context_len: int | None = None
    # Several workers: the one to move it on (the web process routes by it; the worker ignores it).
    worker: str | None = None


class MoeOffloadArgs(ModelArgs):
    # Checked by the worker: an unknown mode is 422 (spec §6).
    mode: str


class KeepAliveArgs(ModelArgs):
    """An Ollama request's keep_alive for its model: seconds from now, negative for forever."""

    secs: float


class KvParkArgs(_Work):
    enabled: bool | None = None
    max_bytes: int | None = None


class SetLimitsArgs(_Work):
    max_loaded_models: int | None = None


class FaultArgs(_Work):
    request_id: str
    # crash: a native SIGSEGV in the engine's thread; hang: that thread stuck in a native call
    # that never returns (a stop must still end the process: hypnos_site/hard_stop.py).
    fault: Literal["crash", "hang"] = "crash"


class AddModelArgs(_Work):
    config: dict[str, Any]


class RemoveModelArgs(ModelArgs):
    drain_secs: float = 120.0


class ChangeModelArgs(RemoveModelArgs):
    """replace_model, update_model: the model's new config block."""

    config: dict[str, Any]


CONTROL_ARGS: dict[str, type[_Work]] = {
    "status": NoArgs,
    "memory_status": NoArgs,
    "move": MoveArgs,
    "set_limits": SetLimitsArgs,
    "kv_park": KvParkArgs,
    "enable": ModelArgs,
    "disable": ModelArgs,
    "moe_offload": MoeOffloadArgs,
    "keep_alive": KeepAliveArgs,
    "fault": FaultArgs,
    "add_model": AddModelArgs,
    "replace_model": ChangeModelArgs,
    "update_model": ChangeModelArgs,
    "remove_model": RemoveModelArgs,
}


class ControlRequest(_Work):
    """One control operation of the worker; `args` are the operation's own fields, checked
    against its CONTROL_ARGS model wherever a request is made or received."""

    type: Literal["control"] = "control"
    request_id: str
    op: ControlOp
    args: dict[str, Any] = {}

    @model_validator(mode="after")
    def _typed_args(self) -> ControlRequest:
        CONTROL_ARGS[self.op].model_validate(self.args)
        return self


WorkerRequest = Annotated[EngineRequest | ControlRequest, Field(discriminator="type")]

# -- announcements ----------------------------------------------------------------------------


class ModelPlace(BaseModel):
    """Where one model of a worker's pool stands, as the worker announces it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aliases: list[str] = []
    enabled: bool = True
    tier: Literal["tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"] = "tier3_nvme_ssd"
    leases: int = 0
    # Requests queued or running on it.
    admitted: int = 0
    # Its weights' bytes once the worker has read its footprint (0 before).
    weight_bytes: int = 0
    tier1_bytes: int = 0
    # The model block's pins and replicas (config.ModelConfig.workers / replicas).
    workers: list[str] = []
    replicas: int = 1


class WorkerAnnouncement(BaseModel):
    """What an inference worker tells the web processes about itself through Redis, every
    ANNOUNCE_SECS with an expiry (inference/transport/cluster.py): a lapsed one is a lost worker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str
    # Its own channel: requests routed to it, and their aborts, go there.
    channel: str
    host: str
    pid: int
    device: str
    simulated: bool
    ready: bool
    # Stopping (SIGTERM): finishing its streams, taking no new work.
    draining: bool = False
    tier1_budget_bytes: int
    tier1_free_bytes: int
    tier2_budget_bytes: int
    tier2_free_bytes: int
    queue_depth: int
    announced_at: float
    models: dict[str, ModelPlace] = {}

    def room_for(self, model_id: str) -> int:
        """Tier-1 bytes it could give `model_id` without evicting a leased model."""
        evictable = sum(p.tier1_bytes for name, p in self.models.items() if p.leases == 0 and name != model_id)
        return self.tier1_free_bytes + evictable


# -- events ----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True, kw_only=True)
class Queued:
    """Admitted; the worker's estimate of the wait before it starts (x-hypnos-estimated-wait-ms)."""

    kind: Literal["queued"] = "queued"
    estimated_wait_ms: float | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Accepted:
    """Channel layer only: the worker that took the request, where its abort goes."""

    kind: Literal["accepted"] = "accepted"
    worker_channel: str


@dataclass(slots=True, frozen=True, kw_only=True)
class Heartbeat:
    kind: Literal["heartbeat"] = "heartbeat"


@dataclass(slots=True, frozen=True, kw_only=True)
class Started:
    """The engine runs; every refusal came before this."""

    kind: Literal["started"] = "started"
    previous_tier: str
    gpu_layers: int | None = None
    tier_switch_ms: float | None = None
    # Issue 17: a chat's prompt tokens, known once it is tokenised (Anthropic's message_start
    # reports them); None where the engine counts them only as it evaluates them (images).
    prompt_tokens: int | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Delta:
    kind: Literal["delta"] = "delta"
    text: str
    logprobs: list[dict[str, Any]] | None = None
    # The engine's deltas this one carries (the transports join them), so that a stream cut
    # before its usage is charged what it generated.
    tokens: int = 1

    def joined(self, later: Delta) -> Delta:
        """This delta and the one right after it as one (the transports batch deltas)."""
        logprobs = (self.logprobs or []) + (later.logprobs or [])
        return Delta(text=self.text + later.text, logprobs=logprobs or None, tokens=self.tokens + later.tokens)


@dataclass(slots=True, frozen=True, kw_only=True)
class Reasoning:
    kind: Literal["reasoning"] = "reasoning"
    text: str


@dataclass(slots=True, frozen=True, kw_only=True)
class AudioChunk:
    kind: Literal["audio"] = "audio"
    data: bytes


@dataclass(slots=True, frozen=True, kw_only=True)
class VectorChunk:
    """Embeddings in input order, each little-endian float32 bytes."""

    kind: Literal["vectors"] = "vectors"
    data: list[bytes]


@dataclass(slots=True, frozen=True, kw_only=True)
class DocumentOpened:
    """The document is read: its page count, the pages that will follow, how it is converted.
    A job adds the picture store's document id when it keeps the pictures."""

    kind: Literal["document_opened"] = "document_opened"
    page_count: int
    pages: list[int]
    format: str
    pipeline: str
    document_id: str | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class PictureFile:
    """One picture of a converted page: its PNG in the request's picture_dir and its place."""

    path: str
    width: int
    height: int
    dpi: int | None = None
    bbox: dict[str, Any] | None = None
    page_size: dict[str, Any] | None = None
    caption: str | None = None
    ref: str | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class DocumentPage:
    """One converted page, as soon as it is ready (worker to job)."""

    kind: Literal["document_page"] = "document_page"
    page: int
    markdown: str
    tables: int
    ms: float
    ocr: bool = False
    json: dict[str, Any] | None = None
    # Every picture of the page; their files only when the request wants them (`pictures`).
    picture_count: int = 0
    pictures: list[PictureFile] = field(default_factory=list)


@dataclass(slots=True, frozen=True, kw_only=True)
class PageReady:
    """A page as the client gets it (job to HTTP stream): the spec's page object, pictures
    described and stored."""

    kind: Literal["page_ready"] = "page_ready"
    page: dict[str, Any]


@dataclass(slots=True, frozen=True, kw_only=True)
class ImageStep:
    """A sampling step of image `index` is done (progress of a long generation)."""

    kind: Literal["image_step"] = "image_step"
    index: int
    step: int
    steps: int


@dataclass(slots=True, frozen=True, kw_only=True)
class ImageReady:
    """Image `index` is done: its PNG in the work's output_dir, the seed it was made with."""

    kind: Literal["image_ready"] = "image_ready"
    index: int
    path: str
    seed: int | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class ImageData:
    """A piece of image `index`'s PNG (job to HTTP request), in order, `last` on its final
    piece: pieces of at most IMAGE_PIECE_BYTES stay under the channel layer's message cap."""

    kind: Literal["image_data"] = "image_data"
    index: int
    data: bytes
    last: bool
    seed: int | None = None


IMAGE_PIECE_BYTES = 256 << 10


@dataclass(slots=True, frozen=True, kw_only=True)
class EntitiesFound:
    """The spans of one input text (`index`), in order; a text with very many spans comes in
    several events of the same index."""

    kind: Literal["entities"] = "entities"
    index: int
    spans: list[Span]


# -- what a media op made (Done.result) -------------------------------------------------------


@dataclass(slots=True, frozen=True, kw_only=True)
class SpeechMade:
    """What a speech op sent as AudioChunks: its length and format facts."""

    kind: Literal["speech_made"] = "speech_made"
    audio_secs: float
    samples: int
    sample_rate: int


@dataclass(slots=True, frozen=True, kw_only=True)
class Embedded:
    kind: Literal["embedded"] = "embedded"
    prompt_tokens: int


MediaResult = Transcript | SpeechMade | Embedded


@dataclass(slots=True, frozen=True, kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, frozen=True, kw_only=True)
class Done:
    """The end of a request: usage and telemetry (hypnos_telemetry, spec §5); `result` for the
    media work (a MediaResult), and for a document conversion the converted document's body
    (the route's JSON answer, built by the job)."""

    kind: Literal["done"] = "done"
    telemetry: dict[str, Any] = field(default_factory=dict)
    usage: Usage | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    result: MediaResult | dict[str, Any] | None = None
    # Issue 17: the stop string that ended a chat (finish_reason "stop"), for Anthropic's
    # stop_reason "stop_sequence"; None when the model ended its turn itself.
    stop_sequence: str | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Result:
    """The one answer of a control operation."""

    kind: Literal["result"] = "result"
    result: Any = None


@dataclass(slots=True, frozen=True, kw_only=True)
class Error:
    """A typed error (hypnos_site.errors) on its way between processes."""

    kind: Literal["error"] = "error"
    error_class: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: str | None = None

    @classmethod
    def of(cls, exc: HypnosError) -> Error:
        return cls(
            error_class=type(exc).__name__,
            message=exc.message,
            param=exc.param,
            code=exc.code,
            retry_after=exc.headers.get("Retry-After"),
        )

    def exception(self) -> HypnosError:
        """The typed exception this event stands for: the one place an error event turns back
        into one (an unknown class is a ServerError)."""
        error = _error_classes().get(self.error_class, ServerError)(self.message, param=self.param, code=self.code)
        if self.retry_after:
            error.headers = {**error.headers, "Retry-After": str(self.retry_after)}
        return error


def _error_classes() -> dict[str, type[HypnosError]]:
    found, todo = {}, [HypnosError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


EngineEvent = Annotated[
    Queued
    | Accepted
    | Heartbeat
    | Started
    | Delta
    | Reasoning
    | AudioChunk
    | VectorChunk
    | DocumentOpened
    | DocumentPage
    | PageReady
    | ImageStep
    | ImageReady
    | ImageData
    | EntitiesFound
    | Done
    | Result
    | Error,
    Field(discriminator="kind"),
]
TERMINAL = (Done, Error, Result)

# -- the serialiser --------------------------------------------------------------------------

_REQUESTS: TypeAdapter[EngineRequest | ControlRequest] = TypeAdapter(WorkerRequest)
_EVENTS: TypeAdapter[Any] = TypeAdapter(EngineEvent)


def encode_request(request: EngineRequest | ControlRequest) -> dict[str, Any]:
    """A request as the channel layer carries it (msgpack: bytes stay bytes)."""
    return request.model_dump()


def decode_request(data: dict[str, Any]) -> EngineRequest | ControlRequest:
    return _REQUESTS.validate_python(data, strict=True)


def encode_event(event: Any) -> dict[str, Any]:
    return _EVENTS.dump_python(event)  # type: ignore[no-any-return]


def decode_event(data: dict[str, Any]) -> Any:
    return _EVENTS.validate_python(data)


# Where an image part stood in a message, in the text the web process hands the worker (the
# images travel beside the messages, in order). llama.cpp's multimodal library reads the same
# marker, so the rendered prompt goes to it as is.
IMAGE_MARKER = "<__media__>"
