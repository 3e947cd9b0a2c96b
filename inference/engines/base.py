"""The engine interface every model kind implements; only the worker imports engines."""

from __future__ import annotations

import importlib
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import ConfigDict, InstanceOf

from hypnos_site.config import LimitsConfig, ModelConfig
from inference.transport.entities import Span
from inference.transport.transcripts import Transcript
from inference.transport.wire import GenerateWork
from memory.kv_park import ParkedState
from memory.planner import Footprint


@dataclass
class LoadPhases:
    """What a load cost, reported as `tier_switch_phases` (spec §5)."""

    load_mode: str
    weights_ms: float
    context_ms: float
    total_ms: float
    projector_ms: float = 0.0
    kv_restore_ms: float | None = None
    kv_restored_tokens: int | None = None

    def plus(self, other: LoadPhases) -> LoadPhases:
        return LoadPhases(
            load_mode=other.load_mode,
            weights_ms=self.weights_ms + other.weights_ms,
            context_ms=self.context_ms + other.context_ms,
            total_ms=self.total_ms + other.total_ms,
            projector_ms=self.projector_ms + other.projector_ms,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "load_mode": self.load_mode,
            "weights_ms": round(self.weights_ms, 1),
            "projector_ms": round(self.projector_ms, 1),
            "context_ms": round(self.context_ms, 1),
            "total_ms": round(self.total_ms, 1),
            **(
                {"kv_restore_ms": round(self.kv_restore_ms, 1), "kv_restored_tokens": self.kv_restored_tokens}
                if self.kv_restore_ms is not None
                else {}
            ),
        }


@dataclass(frozen=True)
class TranscribeOptions:
    """A transcription's request fields, as Engine.transcribe reads them."""

    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False


@dataclass
class PreparedPrompt:
    """What an engine made of a chat before it starts (Engine.prepare_chat), kept for chat()."""

    # The prompt's tokens; None when the engine counts them only as it evaluates them (images).
    tokens: list[int] | None
    # The engine's own plan (template output, grammar, tool handling).
    plan: Any = None


class ChatWork(GenerateWork):
    """One chat as the worker runs it: the request's GenerateWork (its fields are defined there
    once) and what the engine's prepare_chat made of it."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    # Set by prepare_chat in the worker, never sent by the web process.
    prepared: InstanceOf[PreparedPrompt] | None = None
    # Set by the worker from the request's x-hypnos-priority: background (a batch's line): its
    # decode steps give way to an interactive request's prompt (llama_slots.SlotScheduler).
    background: bool = False

    @classmethod
    def of(cls, work: GenerateWork) -> ChatWork:
        """The request's work as the engine runs it: the same fields, already valid."""
        return cls.model_construct(**dict(work))


@dataclass
class ImageSpec:
    """One image as an engine makes it; the worker has checked and clamped every field (size,
    steps, cfg_scale) against the model's [models.image] and the limits."""

    prompt: str
    negative_prompt: str = ""
    width: int = 512
    height: int = 512
    # None: the model's own default ([models.image], else the engine's).
    steps: int | None = None
    cfg_scale: float | None = None
    # This image's own seed: the request's seed plus the image's index (spec §11).
    seed: int = 0
    # Edits and variations (img2img): the reference images as RGB uint8 arrays [H, W, 3], and
    # how far the result may move from them (0: the reference, 1: a fresh image).
    references: list[Any] = field(default_factory=list)
    strength: float = 0.75


class DeltaSink(Protocol):
    """Takes a piece of streamed answer text and, when asked for, its tokens' log probabilities;
    with `reasoning` true the piece is thoughts instead (spec §7.4: they come before the answer)."""

    def __call__(self, text: str, logprobs: list[dict[str, Any]] | None, reasoning: bool = False, /) -> None: ...


@dataclass
class ChatResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Most requests that shared a decode step with this one (itself included).
    concurrent_slots: int = 1
    # The stop string that ended the answer (finish_reason "stop"), None for an end of turn.
    stop_sequence: str | None = None

    def engine_timings(self) -> dict[str, Any]:
        prefill_tokens = max(self.prompt_tokens - self.cached_tokens, 0)
        decoded = max(self.completion_tokens - 1, 0)
        return {
            "prefill_ms": round(self.prefill_ms, 1),
            "decode_ms": round(self.decode_ms, 1),
            "ttft_ms": round(self.ttft_ms, 1),
            "prefill_tokens_per_s": round(prefill_tokens / (self.prefill_ms / 1000), 1) if self.prefill_ms > 0 else 0.0,
            "decode_tokens_per_s": round(decoded / (self.decode_ms / 1000), 1) if self.decode_ms > 0 else 0.0,
            "cached_tokens": self.cached_tokens,
            "concurrent_slots": self.concurrent_slots,
        }


class Engine(ABC):
    """A model of one engine kind and its place in the tiers. The worker moves it:

    - `warm()`: tier 3 -> tier 2, the weights read into memory the worker owns;
    - `load(context_len, gpu_layers)`: -> tier 1, from the warm copy when there is one (no disk
      read), else from the file (the warm copy is made on the way);
    - `unload()`: tier 1 -> tier 2, the engine context released, the warm copy kept;
    - `cool()`: -> tier 3, everything released and the file's page cache dropped, so the next
      load is really cold.

    Methods are called from worker threads, one at a time per engine (the worker's slots and
    load locks guard that)."""

    #: How many requests may run at once on one loaded engine.
    max_concurrency = 1
    #: MoE offload: the routed experts of this many layers, counted from the last, load into
    #: host memory at the next `load` (the worker sets it from the placement; 0 keeps them with
    #: their layer, and engines without experts ignore it).
    cpu_expert_layers = 0

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        self.model = model
        self.weights = weights
        self.n_threads = n_threads
        # The model block's aux file (a projector or a VAE), resolved under models_dir.
        self.aux = aux
        self._warm: WarmCopy | None = None

    @property
    @abstractmethod
    def loaded(self) -> bool: ...

    @property
    def context_len(self) -> int:
        """The context the loaded engine funds (0 when not loaded). An engine without a text
        context funds its block's once loaded, so a loaded model is never loaded again for a
        request (TierMoves.ensure_tier1 compares this with what the request needs)."""
        return self.model.context_len if self.loaded else 0

    @property
    def trained_context_len(self) -> int:
        """The longest context the model supports, once known (0 when unknown)."""
        return 0

    @abstractmethod
    def footprint(self) -> Footprint:
        """What the model needs, read from its files (no load)."""

    @property
    def warm_bytes(self) -> int:
        """Bytes of weights held in worker-owned memory (0 in tier 3)."""
        return self._warm.size if self._warm else 0

    @abstractmethod
    def warm(self) -> float:
        """Hold the weights in worker-owned memory; the milliseconds it took (0 if already)."""

    def _hold(self, source: Path) -> float:
        """The shared part of `warm`: copy `source` into a memfd once; the milliseconds it took."""
        if self._warm is not None:
            return 0.0
        started = time.perf_counter()
        self._warm = WarmCopy(source)
        return (time.perf_counter() - started) * 1000

    def _release(self, files: list[Path]) -> None:
        """The shared part of `cool`: close the warm copy and drop the files' page cache."""
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        for path in files:
            drop_page_cache(path)

    @abstractmethod
    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        """Make the engine ready to serve with `context_len` tokens of context."""

    @abstractmethod
    def unload(self) -> None:
        """Release the engine context; keep the warm copy."""

    @abstractmethod
    def cool(self) -> None:
        """Release everything and drop the file's page cache."""

    def kv_layout(self) -> tuple[Any, ...] | None:
        """What a parked KV state must match to be restored (None: nothing to park)."""
        return None

    def park(self) -> ParkedState | None:
        """The loaded context's conversation state, for KV parking (None when there is none)."""
        return None

    def restore(self, state: ParkedState) -> int:
        """Put a parked state back into the freshly loaded context; the tokens restored."""
        return 0

    def empty_idle_slots(self, idle_secs: float) -> int:
        """Empty the KV of the slots whose conversation has been idle for `idle_secs` or more
        (server.kv_idle_timeout_secs); the tokens dropped. Called while the model is idle."""
        return 0

    def capabilities(self) -> set[str]:
        """What the model can do beyond its modality: `tools`, `thinking`; for image models
        `edit` (img2img from references), `upscale`, `ignores_prompt` (an unconditional
        generator, seeded by the prompt)."""
        return set()

    def prepare_chat(self, work: ChatWork, limits: LimitsConfig) -> ChatWork:
        """Everything that may refuse a chat before it runs (the prompt rendered and tokenised,
        its grammar built), done before the worker reports `started`, so the refusal is a 4xx
        before a stream's first byte; the work with it in `prepared`. Called on a loaded engine."""
        return work

    def check_context(self, work: ChatWork) -> None:
        """ContextLengthExceeded when the prepared prompt leaves no room in the loaded context."""
        return None

    def count_prompt(self, work: ChatWork) -> int:
        """The prepared chat's prompt tokens, images included, evaluating nothing (POST
        /v1/messages/count_tokens); the same count its generation reports as prompt_tokens."""
        tokens = work.prepared.tokens if work.prepared is not None else None
        if tokens is None:
            raise NotImplementedError(f"{type(self).__name__} counts no prompt it has not tokenised")
        return len(tokens)

    def chat(self, work: ChatWork, cancel: threading.Event, on_delta: DeltaSink) -> ChatResult:
        raise NotImplementedError(f"{type(self).__name__} does not serve chat completions")

    # Media modalities (inference/worker/media.py drives them; inference/engines/audio.py
    # decodes, resamples and encodes around them).

    def embed(self, inputs: list[str] | list[list[int]], cancel: threading.Event) -> tuple[list[Any], int]:
        """One normalized float32 vector per input, a text or an array of the model's token ids
        (taken as given), each evaluated alone (so a batch gives exactly the vectors of single
        calls), and the prompt tokens they took. An id outside the vocabulary is InvalidRequest,
        an input longer than the context ContextLengthExceeded."""
        raise NotImplementedError(f"{type(self).__name__} does not serve embeddings")

    def transcribe(self, samples: Any, options: TranscribeOptions, cancel: threading.Event) -> Transcript:
        """Mono float32 samples at 16 kHz -> the text, its language and its timed segments."""
        raise NotImplementedError(f"{type(self).__name__} does not serve speech-to-text")

    def speech_language(self, voice: str, language: str | None) -> str:
        """The language `voice` speaks a request's text in: `language` (ISO 639-1, or a tag such
        as en-GB) when the voice can speak it, its own without one; InvalidRequest otherwise.
        Asked before the request starts, so that a refusal is a 400, streamed or not."""
        raise NotImplementedError(f"{type(self).__name__} does not serve text-to-speech")

    def synthesize(self, text: str, voice: str, speed: float, language: str) -> tuple[Any, int]:
        """One phrase in `language` (what speech_language resolved) -> mono float32 samples in
        [-1, 1] and their sample rate."""
        raise NotImplementedError(f"{type(self).__name__} does not serve text-to-speech")

    # Images (inference/worker/images.py drives them): RGB uint8 arrays [H, W, 3] in and out.

    def image_size(self) -> tuple[int, int] | None:
        """A generator that makes one size only: its (width, height); None when any size goes."""
        return None

    def generate_image(
        self, spec: ImageSpec, cancel: threading.Event, on_step: Callable[[int, int], None] | None = None
    ) -> Any:
        """One image for `spec` (from its references when it has any), RGB uint8 [H, W, 3];
        `on_step(step, steps)` after each sampling step. The same spec gives the same pixels."""
        raise NotImplementedError(f"{type(self).__name__} does not generate images")

    def upscale_factors(self) -> list[int]:
        """The factors `upscale_image` takes (empty: not an upscaler)."""
        return []

    def upscale_image(self, image: Any, factor: int, cancel: threading.Event) -> Any:
        """`image` (RGB uint8 [H, W, 3]) enlarged `factor` times, tile by tile, so memory stays
        bounded for a large image."""
        raise NotImplementedError(f"{type(self).__name__} does not upscale images")

    def extract(
        self, texts: list[str], labels: list[str], threshold: float, flat: bool, cancel: threading.Event
    ) -> list[list[Span]]:
        """Zero-shot entities (spec §13): for each text, its spans of the given labels scoring at
        least `threshold`, flat or nested (inference.transport.entities.select_spans), offsets in the
        text's characters. More labels than a family and texts longer than a window are the
        engine's to split and merge."""
        raise NotImplementedError(f"{type(self).__name__} does not serve entity extraction")


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (clean, unmapped pages go at once)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class WarmCopy:
    """A file's bytes in an anonymous in-memory file (memfd) owned by the worker. Engines that
    open files by path open `path`, which reads from RAM, never from the disk."""

    def __init__(self, source: Path):
        self.fd = os.memfd_create(f"hypnos:{source.name}", os.MFD_CLOEXEC)
        try:
            with open(source, "rb") as src:
                size, offset = os.fstat(src.fileno()).st_size, 0
                while offset < size:
                    # In-kernel copy: the bytes never pass through Python.
                    sent = os.sendfile(self.fd, src.fileno(), offset, size - offset)
                    if sent == 0:
                        raise OSError(f"short copy of {source}")
                    offset += sent
        except BaseException:
            os.close(self.fd)
            raise
        self.size = os.fstat(self.fd).st_size

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


ENGINE_CLASSES = {
    "ggml_llama": "inference.engines.llama.LlamaEngine",
    # "<kind>:<modality>" wins over "<kind>" for models of that modality.
    "ggml_llama:embeddings": "inference.engines.embedding.LlamaEmbeddingEngine",
    # Whisper through faster-whisper (CTranslate2); the spec's kind for Whisper models.
    "ggml_whisper": "inference.engines.whisper.WhisperEngine",
    # Speech voices in ONNX (Piper here; Kokoro on a GPU box).
    "onnx_runtime": "inference.engines.speech.OnnxSpeechEngine",
    # Document conversion: docling's model-free backends plus PP-OCRv4 on onnxruntime.
    "docling": "inference.engines.document.DoclingEngine",
    # Zero-shot entities: GLiNER's ONNX exports on onnxruntime with `tokenizers` (no torch).
    "gliner": "inference.engines.gliner.GlinerEngine",
    # Images: stable-diffusion.cpp (SD 1.x/2.x/XL, SD3, FLUX), an ONNX generator (the DCGAN
    # face model of the CPU lineup), Real-ESRGAN upscalers on ncnn.
    "ggml_diffusion": "inference.engines.diffusion.DiffusionEngine",
    "onnx_runtime:image_generation": "inference.engines.image_onnx.OnnxImageEngine",
    "ncnn": "inference.engines.upscale.NcnnUpscaleEngine",
}


def engine_class(kind: str, modality: str | None = None) -> type[Engine]:
    """The engine class for a model block's `engine`, imported on first use (worker only)."""
    try:
        dotted = ENGINE_CLASSES.get(f"{kind}:{modality}") or ENGINE_CLASSES[kind]
    except KeyError:
        raise NotImplementedError(f"engine {kind!r} is not available in this build") from None
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)
