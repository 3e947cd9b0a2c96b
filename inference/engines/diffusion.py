"""Image generation with stable-diffusion.cpp through stable-diffusion-cpp-python: the SD 1.x/2.x,
SDXL, SD3, FLUX.1/FLUX.2, Qwen-Image and Z-Image files users bring.

A model block names up to three kinds of file, as stable-diffusion.cpp takes them:

- `weights_path`: a whole checkpoint (its tensors carry component prefixes such as
  `model.diffusion_model.`, `first_stage_model.`, `text_encoders.`), or a bare diffusion model
  (FLUX, FLUX.2, Qwen-Image, Z-Image ship so) whose tensors carry none;
- `aux_path`: the VAE, or TAESD (its tensors are `encoder.layers.*` / `decoder.layers.*`) which
  then encodes and decodes in the VAE's place;
- `[models.image] text_encoders`: role -> file (clip_l, clip_g, t5xxl, llm, clip_vision,
  llm_vision), relative to models_dir.

Tier 2 holds every one of those files in a memfd; stable-diffusion.cpp opens paths and tells
formats by their content, so it is handed `/proc/self/fd/N` and a promotion reads no disk. A
load copies the tensors into stable-diffusion.cpp's own buffers (tier 1); an unload frees them.

A generation is txt2img, or for a model with `[models.image] edit = true` and references,
img2img from the first reference at `spec.strength`; the families that condition on reference
images in context (FLUX.2, FLUX.1 Kontext, Qwen-Image-Edit) get every reference that way as
well. stable-diffusion.cpp has no way to stop a generation once it runs: `cancel` is honoured
before it starts and after it ends (the image is then dropped), not between steps.
`on_step(step, steps)` follows stable-diffusion.cpp's progress callback, once per sampling step.
The library seeds its own generator from `spec.seed`, so the same spec gives the same pixels.
A size off the model's latent grid is made on the next grid size up and centre-cropped."""

from __future__ import annotations

import ctypes
import json
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import stable_diffusion_cpp as sd_cpp
from PIL import Image
from stable_diffusion_cpp.stable_diffusion import (
    SAMPLE_METHOD_MAP,
    SCHEDULER_MAP,
    StableDiffusion,
)

from hypnos_site.config import ImageConfig, ModelConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable, ServerError
from inference.engines.base import Engine, ImageSpec, LoadPhases, WarmCopy
from memory.gguf import GgufError, read_gguf
from memory.planner import Footprint, footprint_from_files

log = logging.getLogger(__name__)

# Measured with the random FLUX.2 klein-shaped test model (tests/diffusion_model.py, 27 MiB of
# weights, 2-core CPU): beyond its weights the process grows ~100 MiB at the load (the Qwen2
# tokenizer's tables, ggml's threads) and peaks ~130 MiB over them through a 512x512 generation
# (the text encoder's 512-token context, the DiT's and TAESD's compute buffers). Rounded up.
# Real models' compute buffers grow with the model and the image: this is a floor for them.
WORKSPACE_BYTES = 160 << 20
# The seed stable-diffusion.cpp takes is an int64, and a negative one means "random".
SEED_MODULUS = 1 << 63
# [models.image] text_encoders roles -> the StableDiffusion argument that takes the file.
TEXT_ENCODER_ARGS = {
    "clip_l": "clip_l_path",
    "clip_g": "clip_g_path",
    "clip_vision": "clip_vision_path",
    "t5xxl": "t5xxl_path",
    "llm": "llm_path",
    "llm_vision": "llm_vision_path",
}
# Tensor name prefixes of a whole checkpoint (a bare diffusion model has none of them).
CHECKPOINT_PREFIXES = (
    "model.diffusion_model.",
    "first_stage_model.",
    "cond_stage_model.",
    "conditioner.",
    "text_encoders.",
)
# Tensors of the families that condition on reference images in context: FLUX.2 (its shared
# modulation), FLUX.1 (double blocks: Kontext edits), Qwen-Image (its image modulation).
REFERENCE_MARKERS = (
    "double_stream_modulation_img.lin.weight",
    "double_blocks.0.",
    "transformer_blocks.0.img_mod.1.weight",
)
# stable-diffusion.cpp's log levels -> Python's.
LOG_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.WARNING, 3: logging.ERROR}

_progress = threading.local()
_errors: deque[tuple[int, str]] = deque(maxlen=16)
_errors_seen = [0]
_errors_lock = threading.Lock()


@sd_cpp.sd_log_callback
def _on_log(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """stable-diffusion.cpp's log lines into Python logging; errors also kept for the message
    of a failed load or generation."""
    line = (text or b"").decode("utf-8", errors="replace").rstrip()
    log.log(LOG_LEVELS.get(level, logging.DEBUG), "%s", line)
    if level >= 3:
        with _errors_lock:
            _errors_seen[0] += 1
            _errors.append((_errors_seen[0], line))


@sd_cpp.sd_progress_callback
def _on_progress(step: int, steps: int, seconds: float, data: ctypes.c_void_p) -> None:
    """The sampler's progress, to the `on_step` of the generation running on this thread (the
    callback is process-wide; loads report through it too, with no `on_step` set)."""
    sink = getattr(_progress, "sink", None)
    if sink is not None and step > 0:
        sink(step, steps)


def _install_callbacks() -> None:
    # stable-diffusion-cpp-python installs a log callback that prints to stderr; ours wins.
    sd_cpp.sd_set_log_callback(_on_log, ctypes.c_void_p(0))
    sd_cpp.sd_set_progress_callback(_on_progress, ctypes.c_void_p(0))


_install_callbacks()
_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]
# glibc keeps freed heap pages for reuse; after an unload they would stay in the process (a
# context's ~100 MiB of small allocations). Absent from other C libraries.
_malloc_trim = getattr(_libc, "malloc_trim", None)


@contextmanager
def _errors_since() -> Iterator[list[str]]:
    """The stable-diffusion.cpp error lines logged while the block runs (filled on exit)."""
    with _errors_lock:
        start = _errors_seen[0]
    found: list[str] = []
    try:
        yield found
    finally:
        with _errors_lock:
            found += [line for seq, line in _errors if seq > start]


class _Generator(StableDiffusion):
    """StableDiffusion that frees the images stable-diffusion.cpp returns (the wrapper copies
    them and leaks the C buffers) and fails cleanly when it returns none, or no context."""

    def __init__(self, **options: Any):
        super().__init__(**options)
        if not self._model.model:
            # new_sd_ctx's restype is a pointer type, so a failed load comes back as a NULL
            # pointer, not None: the wrapper takes it for a context and would free it (a segfault).
            self._model.model = None
            raise ValueError("stable-diffusion.cpp could not build the model")

    def _sd_image_t_p_to_images(self, c_images: Any, count: int, upscale_factor: int) -> list[Image.Image]:
        if not c_images:
            raise ServerError("stable-diffusion.cpp made no image")
        try:
            return list(super()._sd_image_t_p_to_images(c_images, count, upscale_factor))
        finally:
            array = ctypes.cast(c_images, ctypes.POINTER(sd_cpp.sd_image_t * count)).contents
            for image in array:
                _libc.free(ctypes.cast(image.data, ctypes.c_void_p))
            _libc.free(ctypes.cast(c_images, ctypes.c_void_p))


def tensor_names(path: Path) -> list[str] | None:
    """The tensor names of a safetensors or GGUF file, from its header (None for another
    format, such as a PyTorch checkpoint)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:4] == b"GGUF":
            try:
                return [t.name for t in read_gguf(path).tensors]
            except (GgufError, struct.error):
                return None
        if len(head) < 8:
            return None
        (size,) = struct.unpack("<Q", head)
        if not 2 < size < (100 << 20):
            return None
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError):
            return None
    return [name for name in header if name != "__metadata__"] if isinstance(header, dict) else None


class DiffusionEngine(Engine):
    """One stable-diffusion.cpp context per model, built from the worker's warm copies."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        super().__init__(model, weights, n_threads, aux)
        self.image = model.image or ImageConfig()
        self._check_sampling()
        self.text_encoders = self._text_encoder_files()
        for path in [weights, *([aux] if aux else []), *self.text_encoders.values()]:
            if not path.is_file():
                raise ModelNotAvailable(f"model {model.id!r}: {path} is missing")
        names = tensor_names(weights)
        # Unknown formats (.ckpt) are whole SD checkpoints in practice.
        self.whole_checkpoint = names is None or any(n.startswith(CHECKPOINT_PREFIXES) for n in names)
        self.takes_references = any(m in n for n in names or [] for m in REFERENCE_MARKERS)
        aux_names = tensor_names(aux) if aux is not None else None
        self.tiny_vae = bool(aux_names) and all(
            n.startswith(("encoder.layers.", "decoder.layers.")) for n in aux_names or []
        )
        self._sd: _Generator | None = None
        # Warm copies beyond the weights' own (`self._warm`): the VAE and the text encoders.
        self._warm_extra: dict[Path, WarmCopy] = {}

    def _check_sampling(self) -> None:
        for value, names, field in (
            (self.image.sampler, SAMPLE_METHOD_MAP, "sampler"),
            (self.image.scheduler, SCHEDULER_MAP, "scheduler"),
        ):
            if value is not None and value.strip().lower() not in names:
                known = ", ".join(k for k in names if not k.endswith("_count"))
                raise ModelNotAvailable(
                    f"model {self.model.id!r}: [models.image] {field} {value!r} is not one of {known}"
                )

    def _text_encoder_files(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for role, name in self.image.text_encoders.items():
            if role not in TEXT_ENCODER_ARGS:
                raise ModelNotAvailable(
                    f"model {self.model.id!r}: text encoder role {role!r} is not one of {', '.join(TEXT_ENCODER_ARGS)}"
                )
            path = Path(name).expanduser()
            if not path.is_absolute():
                from hypnos_site.config import get_config

                path = get_config().models_dir / path
            found[role] = path
        return found

    @property
    def files(self) -> list[Path]:
        return [self.weights, *([self.aux] if self.aux else []), *self.text_encoders.values()]

    @property
    def loaded(self) -> bool:
        return self._sd is not None

    @property
    def warm_bytes(self) -> int:
        return super().warm_bytes + sum(copy.size for copy in self._warm_extra.values())

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    def capabilities(self) -> set[str]:
        return {"edit"} if self.image.edit else set()

    def warm(self) -> float:
        missing = [path for path in self.files[1:] if path not in self._warm_extra]
        if self._warm is not None and not missing:
            return 0.0
        started = time.perf_counter()
        self._hold(self.weights)
        for path in missing:
            self._warm_extra[path] = WarmCopy(path)
        return (time.perf_counter() - started) * 1000

    def _warm_path(self, path: Path) -> str:
        copy = self._warm if path == self.weights else self._warm_extra[path]
        assert copy is not None
        return copy.path

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        weights_ms = self.warm()
        paths: dict[str, Any] = {
            "model_path" if self.whole_checkpoint else "diffusion_model_path": self._warm_path(self.weights)
        }
        if self.aux is not None:
            paths["taesd_path" if self.tiny_vae else "vae_path"] = self._warm_path(self.aux)
        for role, path in self.text_encoders.items():
            paths[TEXT_ENCODER_ARGS[role]] = self._warm_path(path)
        with _errors_since() as errors:
            try:
                # verbose=True: otherwise the wrapper silences the whole process's stdout and
                # stderr around every call; the lines go to Python logging instead (_on_log).
                self._sd = _Generator(
                    **paths,
                    n_threads=self.n_threads or -1,
                    vae_decode_only=not self.image.edit,
                    verbose=True,
                )
            except (ValueError, RuntimeError, OSError) as exc:
                failure: Exception | None = exc
            else:
                failure = None
        if failure is not None:
            detail = "; ".join(errors[-4:]) or str(failure)
            raise ModelNotAvailable(
                f"model {self.model.id!r} could not be loaded from {self.weights}: {detail}"
            ) from failure
        # The wrapper makes its own logger verbose on every construction; it would print() a
        # system-info block at every generation.
        logging.getLogger("stable-diffusion-cpp-python").setLevel(logging.WARNING)
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms or total_ms, context_ms=0.0, total_ms=total_ms)

    def unload(self) -> None:
        if self._sd is not None:
            self._sd.close()
            self._sd = None
            if _malloc_trim is not None:
                _malloc_trim(0)

    def cool(self) -> None:
        self.unload()
        for copy in self._warm_extra.values():
            copy.close()
        self._warm_extra.clear()
        self._release(self.files)

    def generate_image(
        self, spec: ImageSpec, cancel: threading.Event, on_step: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """One image for `spec` (see the module docstring), RGB uint8 [height, width, 3]."""
        assert self._sd is not None, "generate_image on an unloaded engine"
        if cancel.is_set():
            raise Cancelled("the image generation was cancelled")
        references = [Image.fromarray(np.ascontiguousarray(r, dtype=np.uint8)) for r in spec.references]
        edit = bool(references) and self.image.edit
        options: dict[str, Any] = {
            "prompt": spec.prompt,
            "negative_prompt": spec.negative_prompt,
            "width": spec.width,
            "height": spec.height,
            "sample_steps": spec.steps or self.image.steps,
            "cfg_scale": self.image.cfg_scale if spec.cfg_scale is None else spec.cfg_scale,
            "sample_method": self.image.sampler or "default",
            "scheduler": self.image.scheduler or "default",
            "seed": spec.seed % SEED_MODULUS,
            "init_image": references[0] if edit else None,
            "strength": spec.strength,
            "ref_images": references if edit and self.takes_references else None,
        }
        _install_callbacks()
        _progress.sink = on_step
        failure: ServerError | None = None
        try:
            with _errors_since() as errors:
                try:
                    images = self._sd.generate_image(**options)
                except ServerError as exc:
                    failure = exc
        finally:
            _progress.sink = None
        if failure is not None:
            detail = "; ".join(errors[-4:]) or "no detail logged"
            raise ServerError(f"model {self.model.id!r}: stable-diffusion.cpp made no image: {detail}") from failure
        if cancel.is_set():
            raise Cancelled("the image generation was cancelled")
        return crop_to_size(np.asarray(images[0].convert("RGB"), dtype=np.uint8), spec.width, spec.height)


def crop_to_size(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """`image` centre-cropped to width x height: stable-diffusion.cpp rounds a size up to its
    model's latent grid (16 px for FLUX.2, 8 or 64 for others), so 72x40 comes back 80x48."""
    top, left = (image.shape[0] - height) // 2, (image.shape[1] - width) // 2
    if top < 0 or left < 0:
        raise ServerError(f"stable-diffusion.cpp made a {image.shape[1]}x{image.shape[0]} image for {width}x{height}")
    return np.ascontiguousarray(image[top : top + height, left : left + width])
