"""Unconditional image generators in ONNX, through onnxruntime: the DCGAN face generator of the
CPU lineup (`gan-face-generate`'s weights, converted once by models_registry/gan_to_onnx.py),
or any graph of the same signature, `z` [n, nz, 1, 1] float32 -> `img` [n, 3, 64, 64] in
[-1, 1]. The size is fixed so the worker can refuse other sizes before a load.

Such a generator takes no text, so the prompt seeds it: the latent is standard normal from
numpy's PCG64 seeded with (seed mod 2**64, crc32 of the prompt's UTF-8), so the same seed and
prompt give the same image, and another seed or prompt another one. Tier 2 holds the graph in a
memfd the session is built from, so a promotion reads no disk."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable
from inference.engines.base import Engine, ImageSpec, LoadPhases
from inference.engines.onnx_session import open_session
from memory.planner import Footprint, footprint_from_files

# Measured with the DCGAN face graph (14.3 MB, 2-core CPU): beyond the graph's bytes, the process
# grows ~36 MB through the first onnxruntime session it creates and a generation (~6 MB when a
# session already ran in the process): the arena, the session's own copy of the weights being
# the graph's bytes, activations of at most 64x32x32 floats.
WORKSPACE_BYTES = 40 << 20
SEED_MODULUS = 1 << 64
IMAGE_SIZE = (64, 64)


def latent(seed: int, prompt: str, nz: int) -> np.ndarray:
    """The generator's input for one image: z [1, nz, 1, 1] float32, standard normal, drawn
    from PCG64 seeded with (seed mod 2**64, crc32 of the prompt's UTF-8)."""
    rng = np.random.Generator(np.random.PCG64([seed % SEED_MODULUS, zlib.crc32(prompt.encode("utf-8"))]))
    return rng.standard_normal((1, nz, 1, 1), dtype=np.float32)


def to_pixels(image: np.ndarray) -> np.ndarray:
    """[3, H, W] in [-1, 1] -> RGB uint8 [H, W, 3], rounded to the nearest level."""
    levels = np.rint((np.clip(image, -1.0, 1.0) + 1.0) * 127.5)
    return np.ascontiguousarray(levels.astype(np.uint8).transpose(1, 2, 0))


class OnnxImageEngine(Engine):
    """An unconditional ONNX generator of one image size, seeded by the prompt."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        super().__init__(model, weights, n_threads, aux)
        self.graph = weights
        self._session: onnxruntime.InferenceSession | None = None
        self._nz = 0

    @property
    def files(self) -> list[Path]:
        return [self.graph]

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    def warm(self) -> float:
        return self._hold(self.graph)

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        weights_ms = self.warm()
        assert self._warm is not None
        session = open_session(self.model.id, self._warm.path, self.graph, self.n_threads)
        self._nz = self._check_signature(session)
        self._session = session
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms or total_ms, context_ms=0.0, total_ms=total_ms)

    def _check_signature(self, session: onnxruntime.InferenceSession) -> int:
        """The latent size nz of a graph taking `z` [n, nz, 1, 1] float and giving `img`
        [n, 3, 64, 64]; ModelNotAvailable for any other."""
        inputs, outputs = session.get_inputs(), session.get_outputs()
        z = inputs[0] if len(inputs) == 1 else None
        img = outputs[0] if len(outputs) == 1 else None
        if (
            z is None
            or img is None
            or (z.name, img.name) != ("z", "img")
            or z.type != "tensor(float)"
            or len(z.shape) != 4
            or not isinstance(z.shape[1], int)
            or list(z.shape[2:]) != [1, 1]
            or len(img.shape) != 4
            or list(img.shape[1:]) != [3, IMAGE_SIZE[1], IMAGE_SIZE[0]]
        ):
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {self.graph.name} takes {[(i.name, i.shape) for i in inputs]} and gives "
                f"{[(o.name, o.shape) for o in outputs]}, not z [n, nz, 1, 1] -> img [n, 3, 64, 64]"
            )
        return int(z.shape[1])

    def unload(self) -> None:
        self._session = None

    def cool(self) -> None:
        self.unload()
        self._release(self.files)

    def capabilities(self) -> set[str]:
        return {"ignores_prompt"}

    def image_size(self) -> tuple[int, int]:
        """(64, 64): the only size the engine's graphs make (a load refuses another)."""
        return IMAGE_SIZE

    def generate_image(
        self, spec: ImageSpec, cancel: threading.Event, on_step: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """One image from the seed and prompt of `spec` (see the module docstring), RGB uint8
        [H, W, 3]; the other fields of `spec` do not apply to an unconditional generator (the
        worker has refused other sizes). One step: `on_step(1, 1)` once it is made."""
        assert self._session is not None, "generate_image on an unloaded engine"
        if cancel.is_set():
            raise Cancelled("the image generation was cancelled")
        (images,) = self._session.run(["img"], {"z": latent(spec.seed, spec.prompt, self._nz)})
        if on_step is not None:
            on_step(1, 1)
        return to_pixels(images[0])
