"""The onnx_runtime image engine on the real DCGAN face generator: `gan-face-generate`'s
weights.tar converted without torch by models_registry/gan_to_onnx.py (or the graph set-up
placed under models_dir), checked against a plain numpy forward pass of the same state dict."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from django.conf import settings
from onnx import TensorProto, helper

from hypnos_site.config import HypnosConfig, ModelConfig, ServerConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable
from inference.engines.base import ImageSpec
from inference.engines.image_onnx import WORKSPACE_BYTES, OnnxImageEngine, latent, to_pixels
from models_registry.gan_to_onnx import convert_dcgan, read_state_dict
from models_registry.packaged import convert_packaged_models, install_packaged_models, needs_conversion

MODEL_ID = "dcgan-faces"
# Mean absolute difference of neighbouring pixels over the image's standard deviation. A photo
# (or a face a trained generator makes) changes slowly from pixel to pixel: 0.15 on average and
# at most 0.25 over 64 seeds of this generator; uniform noise gives 1.15, and the same graph with
# each weight tensor shuffled (the architecture right, the training lost) 1.1.
SMOOTH_FACE_LIMIT = 0.4


def weights_tar() -> Path:
    spec = importlib.util.find_spec("gan_face_generate")
    assert spec is not None and spec.submodule_search_locations, "gan-face-generate is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "weights.tar"


def block(weights: Path) -> ModelConfig:
    return ModelConfig(id=MODEL_ID, modality="image_generation", engine="onnx_runtime", weights_path=str(weights))


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The graph set-up placed, else the package's weights converted here."""
    config = settings.HYPNOS
    placed = next((config.weights_file(m) for m in config.models if m.id == MODEL_ID), None)
    if placed is not None and placed.is_file():
        return placed
    dest = tmp_path_factory.mktemp("dcgan") / "dcgan-faces-64.onnx"
    convert_dcgan(weights_tar(), dest)
    return dest


@pytest.fixture(scope="module")
def state() -> dict[str, np.ndarray]:
    return read_state_dict(weights_tar())


@pytest.fixture(scope="module")
def engine(graph: Path) -> Iterator[OnnxImageEngine]:
    engine = OnnxImageEngine(block(graph), graph, 2)
    engine.load(0, 0)
    yield engine
    engine.cool()


def generate(engine: OnnxImageEngine, prompt: str = "a face", seed: int = 7) -> np.ndarray:
    return engine.generate_image(ImageSpec(prompt=prompt, seed=seed), threading.Event())


def conv_transpose(x: np.ndarray, w: np.ndarray, stride: int, padding: int) -> np.ndarray:
    """torch.nn.ConvTranspose2d by its definition: each input pixel scatters its kernel-weighted
    channels to out[y * stride + i - padding, x * stride + j - padding]."""
    n, _, h, width = x.shape
    k = w.shape[2]
    full = np.zeros((n, w.shape[1], (h - 1) * stride + k, (width - 1) * stride + k))
    for i in range(k):
        for j in range(k):
            contribution = np.einsum("nchw,co->nohw", x, w[:, :, i, j])
            full[:, :, i : i + (h - 1) * stride + 1 : stride, j : j + (width - 1) * stride + 1 : stride] += contribution
    return full[:, :, padding : full.shape[2] - padding, padding : full.shape[3] - padding]


def numpy_generator(state: dict[str, np.ndarray], z: np.ndarray) -> np.ndarray:
    """models.py's Generator.forward in float64 numpy, read straight from the state dict."""
    x = z.astype(np.float64)
    for index, (stride, padding) in zip((0, 3, 6, 9, 12), ((1, 0), (2, 1), (2, 1), (2, 1), (2, 1)), strict=True):
        x = conv_transpose(x, state[f"main.{index}.weight"].astype(np.float64), stride, padding)
        if index == 12:
            return np.tanh(x)
        p = f"main.{index + 1}."
        scale, bias, mean, var = (
            state[p + n].astype(np.float64)[None, :, None, None]
            for n in ("weight", "bias", "running_mean", "running_var")
        )
        x = np.maximum((x - mean) / np.sqrt(var + 1e-5) * scale + bias, 0.0)
    raise AssertionError("unreachable")


def roughness(image: np.ndarray) -> float:
    g = image.astype(np.float64)
    steps = (np.abs(np.diff(g, axis=0)).mean() + np.abs(np.diff(g, axis=1)).mean()) / 2
    return float(steps / g.std())


def test_it_runs_without_torch(engine: OnnxImageEngine) -> None:
    generate(engine)
    assert "torch" not in sys.modules


def test_it_makes_one_64x64_rgb_image_in_one_step(engine: OnnxImageEngine) -> None:
    steps: list[tuple[int, int]] = []
    spec = ImageSpec(prompt="a face", width=512, height=512, steps=20, cfg_scale=7.0, seed=3)
    image = engine.generate_image(spec, threading.Event(), lambda step, total: steps.append((step, total)))
    assert (image.shape, image.dtype, steps) == ((64, 64, 3), np.uint8, [(1, 1)])
    assert engine.image_size() == (64, 64)
    assert engine.capabilities() == {"ignores_prompt"}
    assert image.min() < 64 and image.max() > 192  # the [-1, 1] range spread over the levels


def test_the_same_seed_and_prompt_give_the_same_pixels(engine: OnnxImageEngine) -> None:
    assert np.array_equal(generate(engine, "a lighthouse", 7), generate(engine, "a lighthouse", 7))


@pytest.mark.parametrize(("prompt", "seed"), [("a lighthouse", 8), ("a lighthouse at dawn", 7)])
def test_another_seed_or_prompt_gives_another_face(engine: OnnxImageEngine, prompt: str, seed: int) -> None:
    first, other = generate(engine, "a lighthouse", 7), generate(engine, prompt, seed)
    assert np.abs(first.astype(int) - other.astype(int)).mean() > 10


def test_the_graph_matches_a_numpy_forward_pass_of_the_state_dict(
    engine: OnnxImageEngine, graph: Path, state: dict[str, np.ndarray]
) -> None:
    z = latent(7, "a face", 100)
    expected = numpy_generator(state, z)
    session = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    (got,) = session.run(["img"], {"z": z})
    assert got.shape == (1, 3, 64, 64)
    assert np.abs(got - expected).max() < 1e-4
    # The pixels are the numpy image's, rounded (at most one level off at a rounding edge).
    assert np.abs(generate(engine, "a face", 7).astype(int) - to_pixels(expected[0]).astype(int)).max() <= 1


def test_the_pixels_are_smooth_like_a_face_not_noise(engine: OnnxImageEngine, state: dict[str, np.ndarray]) -> None:
    faces = [roughness(generate(engine, f"face {seed}", seed)) for seed in range(16)]
    assert max(faces) < SMOOTH_FACE_LIMIT, faces
    # The statistic tells trained weights from untrained ones: the same architecture with each
    # weight tensor shuffled makes noise-like images.
    rng = np.random.default_rng(0)
    shuffled = {k: rng.permutation(v.reshape(-1)).reshape(v.shape) if v.ndim == 4 else v for k, v in state.items()}
    noise_like = [roughness(to_pixels(numpy_generator(shuffled, latent(s, "", 100))[0])) for s in range(2)]
    assert min(noise_like) > 2 * SMOOTH_FACE_LIMIT, noise_like
    assert roughness(rng.integers(0, 256, (64, 64, 3))) > 2 * SMOOTH_FACE_LIMIT


def test_it_moves_through_the_tiers(graph: Path) -> None:
    engine = OnnxImageEngine(block(graph), graph, 2)
    footprint = engine.footprint()
    assert footprint.other_bytes == graph.stat().st_size > 0 and footprint.workspace_bytes == WORKSPACE_BYTES
    assert (engine.loaded, engine.warm_bytes) == (False, 0)
    assert engine.load(0, 0).load_mode == "read"
    assert engine.loaded and engine.warm_bytes == graph.stat().st_size
    cold = generate(engine)
    engine.unload()
    assert (engine.loaded, engine.warm_bytes) == (False, graph.stat().st_size)
    assert engine.warm() == 0.0
    assert engine.load(0, 0).load_mode == "mmap"
    assert np.array_equal(generate(engine), cold)
    engine.cool()
    assert (engine.loaded, engine.warm_bytes) == (False, 0)
    engine.warm()
    assert engine.warm_bytes == graph.stat().st_size
    engine.cool()


def test_a_cancelled_request_makes_no_image(engine: OnnxImageEngine) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        engine.generate_image(ImageSpec(prompt="a face"), cancel)


def test_a_corrupt_graph_is_not_available(graph: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(graph.read_bytes()[: 1 << 20])
    engine = OnnxImageEngine(block(corrupt), corrupt, 2)
    with pytest.raises(ModelNotAvailable, match="could not be loaded"):
        engine.load(0, 0)
    assert not engine.loaded
    engine.cool()


def test_a_graph_of_another_signature_is_not_available(tmp_path: Path) -> None:
    # A valid graph, but its img is the latent itself: [n, 100, 1, 1], not an RGB 64x64.
    other = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["z"], ["img"])],
            "other",
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 100, 1, 1])],
            [helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 100, 1, 1])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    path = tmp_path / "other.onnx"
    onnx.save(other, path)
    engine = OnnxImageEngine(block(path), path, 2)
    with pytest.raises(ModelNotAvailable, match=r"not z \[n, nz, 1, 1\] -> img \[n, 3, 64, 64\]"):
        engine.load(0, 0)
    assert not engine.loaded
    engine.cool()


def test_set_up_converts_the_packaged_weights_once(tmp_path: Path) -> None:
    model = ModelConfig(
        id=MODEL_ID,
        modality="image_generation",
        engine="onnx_runtime",
        weights_path="dcgan-faces-64.onnx",
        package="gan-face-generate",
        package_path="weights.tar",
    )
    config = HypnosConfig(server=ServerConfig(models_dir=str(tmp_path)), models=[model])
    assert needs_conversion(model)
    assert install_packaged_models(config) == []  # installmodels leaves the torch file alone
    dest = tmp_path / "dcgan-faces-64.onnx"
    assert convert_packaged_models(config) == [(MODEL_ID, dest, True)]
    assert onnx.load(dest).graph.output[0].name == "img"
    assert convert_packaged_models(config) == [(MODEL_ID, dest, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcgan-faces-64.onnx"]
