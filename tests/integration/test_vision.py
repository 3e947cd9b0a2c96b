"""Image parts in chat (spec §7.1) through llama.cpp's multimodal library on the real SmolLM2.

No vision-language model or projector ships on any package registry these machines reach, so
the projector here is built by the test: a tiny CLIP vision tower (32x32 images, 8x8 patches,
two layers) and a LLaVA MLP projector into SmolLM2's 576-wide embeddings, with random weights
and the exact GGUF keys and tensor names llama.cpp's clip.cpp reads. It proves the whole path
(request -> image decode -> projector -> image embeddings in the prompt -> generation), not
that the model understands the picture: with random weights what it writes is meaningless.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import gguf
import numpy as np
import pytest
from PIL import Image

from inference.worker import Worker
from memory.gguf import read_gguf
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
SMOL = "smollm2-135m"
SEEING = "smollm2-seeing"
IMAGE_SIZE, PATCH_SIZE = 32, 8
# A LLaVA MLP projector gives one embedding per patch.
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2


def write_tiny_projector(path: Path, text_embd: int, seed: int = 0) -> None:
    """A projector GGUF as llama.cpp's convert scripts write one for LLaVA 1.5 ("mlp")."""
    rng = np.random.default_rng(seed)
    width, heads, ffn, hidden, layers = 32, 2, 64, 64, 2
    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", ffn)
    writer.add_uint32("clip.vision.block_count", layers)
    writer.add_uint32("clip.vision.projection_dim", text_embd)
    writer.add_uint32("clip.vision.attention.head_count", heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def tensor(name: str, *shape: int, fill: float | None = None) -> None:
        # numpy shapes are ggml's dimensions reversed: a (out, in) matrix maps in -> out.
        data = np.full(shape, fill) if fill is not None else rng.standard_normal(shape) * 0.02
        writer.add_tensor(name, data.astype(np.float32))

    tensor("v.patch_embd.weight", width, 3, PATCH_SIZE, PATCH_SIZE)
    tensor("v.patch_embd.bias", width)
    tensor("v.position_embd.weight", n_patches, width)
    for il in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"v.blk.{il}.{name}.weight", width, width)
            tensor(f"v.blk.{il}.{name}.bias", width)
        for norm in ("ln1", "ln2"):
            tensor(f"v.blk.{il}.{norm}.weight", width, fill=1.0)
            tensor(f"v.blk.{il}.{norm}.bias", width, fill=0.0)
        tensor(f"v.blk.{il}.ffn_up.weight", ffn, width)
        tensor(f"v.blk.{il}.ffn_up.bias", ffn)
        tensor(f"v.blk.{il}.ffn_down.weight", width, ffn)
        tensor(f"v.blk.{il}.ffn_down.bias", width)
    tensor("mm.0.weight", hidden, width)
    tensor("mm.0.bias", hidden)
    tensor("mm.2.weight", text_embd, hidden)
    tensor("mm.2.bias", text_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def png_data_url(color: tuple[int, int, int] = (220, 40, 40), size: tuple[int, int] = (48, 40)) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    from django.conf import settings

    weights = settings.HYPNOS.weights_file(next(m for m in settings.HYPNOS.models if m.id == SMOL))
    path = tmp_path_factory.mktemp("vision") / "tiny-mmproj.gguf"
    write_tiny_projector(path, int(read_gguf(weights).metadata["llama.embedding_length"]))
    return path


@pytest.fixture
def seeing(settings, serve, projector) -> Worker:
    """SmolLM2 twice: as configured (no projector) and as `smollm2-seeing` with the tiny projector."""
    smol = next(m for m in settings.HYPNOS.models if m.id == SMOL)
    seeing = smol.model_copy(
        update={
            "id": SEEING,
            "aliases": [],
            "aux_path": str(projector),
            "initial_tier": "tier3_nvme_ssd",
            "speech_to_text_model": None,
        }
    )
    config = settings.HYPNOS.model_copy(update={"models": [smol, seeing]})
    settings.HYPNOS = config
    return serve(config)


def ask(model: str, *parts: dict, **extra: object) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": list(parts)}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }


TEXT = {"type": "text", "text": "Describe the picture."}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


async def test_an_image_reaches_the_model_through_the_projector(api, seeing):
    text_only = (await post_json(api, URL, ask(SEEING, TEXT))).json()
    response = await post_json(api, URL, ask(SEEING, image(png_data_url()), TEXT))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + TOKENS_PER_IMAGE
    # Meaningless text (random projector weights), but generated after the image embeddings.
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
    phases = [p for p in (text_only, body) if "tier_switch_phases" in p["hypnos_telemetry"]]
    assert phases and phases[0]["hypnos_telemetry"]["tier_switch_phases"]["projector_ms"] > 0


async def test_two_images_take_two_images_worth_of_tokens(api, seeing):
    one = (await post_json(api, URL, ask(SEEING, image(png_data_url()), TEXT))).json()
    two = (await post_json(api, URL, ask(SEEING, image(png_data_url()), image(png_data_url((0, 0, 255))), TEXT))).json()
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] + TOKENS_PER_IMAGE


async def test_an_image_changes_what_the_model_writes(api, seeing):
    red = (await post_json(api, URL, ask(SEEING, image(png_data_url((255, 0, 0))), TEXT, max_tokens=8))).json()
    again = (await post_json(api, URL, ask(SEEING, image(png_data_url((255, 0, 0))), TEXT, max_tokens=8))).json()
    text_only = (await post_json(api, URL, ask(SEEING, TEXT, max_tokens=8))).json()
    # Greedy decoding: the same image gives the same text; the image's embeddings are in the
    # context, so the text differs from the text-only prompt's.
    assert red["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert red["choices"][0]["message"]["content"] != text_only["choices"][0]["message"]["content"]


async def test_a_text_request_after_an_image_does_not_reuse_the_image_positions(api, seeing):
    await post_json(api, URL, ask(SEEING, image(png_data_url()), TEXT))
    fresh = (await post_json(api, URL, ask(SEEING, TEXT))).json()
    assert fresh["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) < fresh["usage"]["prompt_tokens"]


async def test_it_streams_an_answer_to_an_image(api, seeing):
    response = await post_json(api, URL, ask(SEEING, image(png_data_url()), TEXT, stream=True))
    assert response.status_code == 200
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    assert raw.rstrip().endswith("data: [DONE]") and '"finish_reason": "error"' not in raw


async def test_a_model_without_a_projector_answers_400(api, seeing):
    response = await post_json(api, URL, ask(SMOL, image(png_data_url()), TEXT))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "vision" in error["message"] and error["param"] == "messages"


async def test_a_bad_image_answers_400(api, seeing, settings):
    response = await post_json(api, URL, ask(SEEING, image("data:image/png;base64,aGVsbG8="), TEXT))
    assert response.status_code == 400 and "image" in response.json()["error"]["message"]
    settings.HYPNOS = settings.HYPNOS.model_copy(
        update={"limits": settings.HYPNOS.limits.model_copy(update={"max_image_bytes": 64})}
    )
    response = await post_json(api, URL, ask(SEEING, image(png_data_url()), TEXT))
    assert response.status_code == 400 and "max_image_bytes" in response.json()["error"]["message"]


async def test_memory_status_lists_vision_among_the_modalities(api, seeing):
    models = {m["id"]: m for m in (await api.get("/v1/memory/status")).json()["models"]}
    assert "vision" in models[SEEING]["modalities"] and "vision" not in models[SMOL]["modalities"]


async def test_the_projector_counts_in_the_models_footprint(api, seeing, projector):
    plain, with_projector = seeing.tiers.entries[SMOL].footprint, seeing.tiers.entries[SEEING].footprint
    assert with_projector.weights_bytes == plain.weights_bytes + projector.stat().st_size


async def test_the_files_of_a_seeing_model_include_its_projector(api, seeing, projector):
    body = (await api.get(f"/v1/models/{SEEING}/files")).json()
    assert [(f["role"], f["exists"]) for f in body["data"]] == [("weights", True), ("aux", True)]
    assert body["data"][1]["size_bytes"] == projector.stat().st_size
