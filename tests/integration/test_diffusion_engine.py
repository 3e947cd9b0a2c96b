"""The stable-diffusion.cpp engine (`ggml_diffusion`), driven directly, no server. No text-to-image
weights are reachable from these machines, so the model is a random-weight FLUX.2 klein-shaped
one built by tests/diffusion_model.py (plumbing, not a trained model): its pictures are noise,
and the tests check what the engine controls (sizes, seeds, prompts, references, steps,
cancellation, tiers, memory, refusals), not what a picture shows."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from hypnos_site.config import ImageConfig, ModelConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable
from inference.engines.base import ImageSpec, engine_class

# stable-diffusion-cpp-python is built by ./run.sh (setup_sdcpp) like llama-cpp-python: a
# machine without it fails here, as every llama test does without llama_cpp.
from inference.engines.diffusion import WORKSPACE_BYTES, DiffusionEngine
from tests.diffusion_model import TinyDiffusionModel, build_tiny_diffusion_model

SIZE = 64


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyDiffusionModel:
    """The random-weight model (plumbing, not a trained model), built once per session."""
    return build_tiny_diffusion_model(tmp_path_factory.mktemp("diffusion-model"))


def config(tiny: TinyDiffusionModel, **image: object) -> ModelConfig:
    return ModelConfig(
        id="tiny-flux2-klein",
        modality="image_generation",
        engine="ggml_diffusion",
        weights_path=str(tiny.weights),
        aux_path=str(tiny.vae),
        image=ImageConfig(steps=2, cfg_scale=1.0, text_encoders={"llm": str(tiny.text_encoder)}, **image),
    )


def make_engine(tiny: TinyDiffusionModel, **image: object) -> DiffusionEngine:
    model = config(tiny, **image)
    # As the worker builds engines (inference/worker/tier_moves.py `engine()`).
    engine = engine_class(model.engine, model.modality)(model, tiny.weights, 2, aux=tiny.vae)
    assert isinstance(engine, DiffusionEngine)
    return engine


@pytest.fixture(scope="module")
def engine(tiny: TinyDiffusionModel) -> Iterator[DiffusionEngine]:
    """One loaded editing engine shared by the generation tests."""
    engine = make_engine(tiny, edit=True)
    engine.load(0, 0)
    yield engine
    engine.cool()


def generate(engine: DiffusionEngine, cancel: threading.Event | None = None, on_step=None, **fields) -> np.ndarray:  # type: ignore[no-untyped-def]
    spec = ImageSpec(**{"prompt": "a lighthouse at dawn", "width": SIZE, "height": SIZE, "seed": 7, **fields})
    return engine.generate_image(spec, cancel or threading.Event(), on_step)


def reference(seed: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_it_makes_an_rgb_image_of_the_asked_size(engine: DiffusionEngine) -> None:
    image = generate(engine, width=64, height=128)
    assert image.shape == (128, 64, 3) and image.dtype == np.uint8
    # Random weights make noise, but not a flat picture: many levels, in every channel.
    assert all(len(np.unique(image[..., c])) > 16 for c in range(3))


def test_a_size_off_the_latent_grid_comes_back_as_asked(engine: DiffusionEngine) -> None:
    # FLUX.2's grid is 16 px: stable-diffusion.cpp makes 80x48, the engine crops the centre.
    assert generate(engine, width=72, height=40).shape == (40, 72, 3)


def test_the_same_seed_gives_the_same_pixels_and_another_seed_others(engine: DiffusionEngine) -> None:
    first, again, other = generate(engine, seed=11), generate(engine, seed=11), generate(engine, seed=12)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_the_prompt_conditions_the_image(engine: DiffusionEngine) -> None:
    assert not np.array_equal(generate(engine, prompt="a red fox"), generate(engine, prompt="a blue whale"))


def test_the_negative_prompt_is_taken_with_guidance(engine: DiffusionEngine) -> None:
    plain = generate(engine, cfg_scale=3.0)
    assert np.array_equal(plain, generate(engine, cfg_scale=3.0))
    assert not np.array_equal(plain, generate(engine, cfg_scale=3.0, negative_prompt="text, watermark"))


def test_an_edit_starts_from_the_first_reference_at_its_strength(engine: DiffusionEngine) -> None:
    fresh = generate(engine)
    edited = generate(engine, references=[reference(1)], strength=0.5)
    assert edited.shape == fresh.shape and not np.array_equal(edited, fresh)
    assert not np.array_equal(edited, generate(engine, references=[reference(2)], strength=0.5))
    # The strength only acts through the start from the reference: stable-diffusion.cpp runs
    # the last steps x strength + 1 steps of the schedule, so 2 steps run whole at 0.5 as at
    # 0.9, while 4 steps run 3 at 0.5 and 4 at 0.9.
    halfway = generate(engine, references=[reference(1)], strength=0.5, steps=4)
    assert not np.array_equal(halfway, generate(engine, references=[reference(1)], strength=0.9, steps=4))
    assert np.array_equal(edited, generate(engine, references=[reference(1)], strength=0.5))


def test_flux2_takes_every_reference_in_context(engine: DiffusionEngine) -> None:
    assert engine.takes_references
    first = generate(engine, references=[reference(1), reference(3)], strength=0.5)
    assert not np.array_equal(first, generate(engine, references=[reference(1), reference(4)], strength=0.5))


def test_a_reference_of_another_size_is_fitted_to_the_image(engine: DiffusionEngine) -> None:
    assert generate(engine, references=[reference(1, size=96)], strength=0.5).shape == (SIZE, SIZE, 3)


def test_on_step_follows_each_sampling_step(engine: DiffusionEngine) -> None:
    steps: list[tuple[int, int]] = []
    generate(engine, steps=3, on_step=lambda step, total: steps.append((step, total)))
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_a_cancelled_generation_does_not_start(engine: DiffusionEngine) -> None:
    cancel = threading.Event()
    cancel.set()
    steps: list[int] = []
    with pytest.raises(Cancelled):
        generate(engine, cancel=cancel, on_step=lambda step, total: steps.append(step))
    assert steps == []


def test_a_generation_cancelled_while_it_runs_gives_no_image(engine: DiffusionEngine) -> None:
    # stable-diffusion.cpp cannot stop mid-run: the steps all run, then the image is dropped.
    cancel = threading.Event()
    steps: list[int] = []

    def on_step(step: int, total: int) -> None:
        steps.append(step)
        cancel.set()

    with pytest.raises(Cancelled):
        generate(engine, cancel=cancel, on_step=on_step)
    assert steps == [1, 2]


def test_a_model_that_does_not_edit_ignores_references(tiny: TinyDiffusionModel) -> None:
    engine = make_engine(tiny)
    assert engine.capabilities() == set()
    engine.load(0, 0)
    try:
        assert np.array_equal(generate(engine), generate(engine, references=[reference(1)], strength=0.5))
    finally:
        engine.cool()


def test_it_moves_through_the_tiers_from_its_warm_copies(tiny: TinyDiffusionModel) -> None:
    engine = make_engine(tiny, edit=True)
    sizes = sum(path.stat().st_size for path in tiny.files)
    footprint = engine.footprint()
    assert not engine.loaded and engine.warm_bytes == 0
    assert footprint.weights_bytes == sizes and footprint.workspace_bytes == WORKSPACE_BYTES
    assert footprint.n_layers == 0 and footprint.kv_bytes_per_token == 0
    assert engine.capabilities() == {"edit"} and engine.image_size() is None

    assert engine.warm() > 0 and engine.warm_bytes == sizes
    assert engine.warm() == 0.0
    phases = engine.load(0, 0)
    assert engine.loaded and phases.load_mode == "mmap" and phases.total_ms > 0
    # stable-diffusion.cpp opened the memfds, not the files.
    opened = [engine._sd.diffusion_model_path, engine._sd.taesd_path, engine._sd.llm_path]
    assert all(path.startswith("/proc/self/fd/") for path in opened)
    first = generate(engine)

    engine.unload()
    assert not engine.loaded and engine.warm_bytes == sizes
    engine.load(0, 0)
    assert np.array_equal(generate(engine), first)

    engine.cool()
    assert not engine.loaded and engine.warm_bytes == 0
    assert engine.load(0, 0).load_mode == "read" and engine.warm_bytes == sizes
    engine.cool()


def test_unloading_gives_the_memory_back(tiny: TinyDiffusionModel) -> None:
    engine = make_engine(tiny, edit=True)
    engine.warm()
    before = rss()
    engine.load(0, 0)
    generate(engine)
    loaded = rss()
    engine.unload()
    after = rss()
    engine.load(0, 0)
    generate(engine)
    engine.unload()
    again = rss()
    engine.cool()
    weights = sum(path.stat().st_size for path in tiny.files)
    # The context holds a copy of the weights and its workspace (the memfds are not mapped,
    # so they are not in RSS); an unload gives back all but the library's one-time set-up.
    assert loaded - before > weights
    assert after - before < weights
    # A second load and unload leaves the process where the first did.
    assert again - after < 8 << 20


def test_missing_files_are_refused(tiny: TinyDiffusionModel, tmp_path: Path) -> None:
    model = config(tiny)
    with pytest.raises(ModelNotAvailable, match="missing"):
        DiffusionEngine(model, tmp_path / "absent.safetensors", 2, aux=tiny.vae)
    lost = model.model_copy(update={"image": ImageConfig(text_encoders={"llm": str(tmp_path / "absent.gguf")})})
    with pytest.raises(ModelNotAvailable, match="missing"):
        DiffusionEngine(lost, tiny.weights, 2, aux=tiny.vae)


def test_a_corrupt_weights_file_is_refused_at_load(tiny: TinyDiffusionModel, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(tiny.weights.read_bytes()[: tiny.weights.stat().st_size // 2])
    engine = DiffusionEngine(config(tiny), corrupt, 2, aux=tiny.vae)
    with pytest.raises(ModelNotAvailable, match="could not be loaded"):
        engine.load(0, 0)
    assert not engine.loaded
    engine.cool()

    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a model" * 100)
    engine = DiffusionEngine(config(tiny), garbage, 2, aux=tiny.vae)
    with pytest.raises(ModelNotAvailable, match="could not be loaded"):
        engine.load(0, 0)
    engine.cool()


def test_an_unknown_sampler_or_role_is_refused(tiny: TinyDiffusionModel) -> None:
    with pytest.raises(ModelNotAvailable, match="sampler"):
        make_engine(tiny, sampler="warp_drive")
    model = config(tiny).model_copy(update={"image": ImageConfig(text_encoders={"vision": str(tiny.text_encoder)})})
    with pytest.raises(ModelNotAvailable, match="role"):
        DiffusionEngine(model, tiny.weights, 2, aux=tiny.vae)
    assert make_engine(tiny, sampler="euler", scheduler="simple").image.sampler == "euler"
