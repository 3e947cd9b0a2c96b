"""The image routes on the `ggml_diffusion` engine (stable-diffusion.cpp) through image jobs. No
diffusion weights ship on any reachable registry, so the model is FLUX.2 klein-shaped with
RANDOM weights, built by tests/diffusion_model.py: plumbing, not a trained model (its images are
noise). What is checked is the path a real model takes: sizes clamped and rounded, seeds,
steps, edits and variations from references, and a client leaving mid-batch."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from hypnos_site.config import ImageConfig, ModelConfig
from inference.worker import Worker
from logs.models import ImageJob
from tests.diffusion_model import TinyDiffusionModel, build_tiny_diffusion_model
from tests.integration.conftest import post_json, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
FLUX = "tiny-flux2-klein"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyDiffusionModel:
    """The random-weight model (plumbing), built once for the module."""
    return build_tiny_diffusion_model(tmp_path_factory.mktemp("diffusion-route"))


@pytest.fixture
def flux(settings, serve_shared, tiny) -> Worker:
    """SmolLM2 and the tiny FLUX.2 model, on a worker the module's tests share (each leaves no
    lease behind), so the diffusion model is loaded once for them."""
    model = ModelConfig(
        id=FLUX,
        modality="image_generation",
        engine="ggml_diffusion",
        weights_path=str(tiny.weights),
        aux_path=str(tiny.vae),
        image=ImageConfig(steps=2, cfg_scale=1.0, edit=True, text_encoders={"llm": str(tiny.text_encoder)}),
    )
    chat = next(m for m in settings.HYPNOS.models if m.id == "smollm2-135m")
    return serve_shared(settings.HYPNOS.model_copy(update={"models": [chat, model]}))


def png(item: dict) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert image.format == "PNG"
    return image


async def generate(api, **body) -> dict:
    response = await post_json(api, "/v1/images/generations", {"model": FLUX, "prompt": "a lighthouse", **body})
    assert response.status_code == 200, response.content
    return response.json()


def reference() -> io.BytesIO:
    upload = io.BytesIO()
    Image.new("RGB", (256, 256), (30, 120, 200)).save(upload, "PNG")
    upload.seek(0)
    upload.name = "ref.png"
    return upload


async def test_a_size_is_clamped_and_rounded_down_to_16(api, flux):
    body = await generate(api, size="300x100", seed=5)
    assert png(body["data"][0]).size == (288, 256)
    engine = body["hypnos_telemetry"]["engine"]
    assert (engine["width"], engine["height"], engine["steps"]) == (288, 256, 2)
    assert engine["steps_done"] >= 2
    assert await wait_until(lambda: flux.tiers.leases(FLUX) == 0, 30)


async def test_the_same_seed_gives_the_same_png_and_another_seed_another(api, flux):
    first = await generate(api, size="256x256", seed=11, negative_prompt="text")
    again = await generate(api, size="256x256", seed=11, negative_prompt="text")
    other = await generate(api, size="256x256", seed=12, negative_prompt="text")
    assert first["data"][0]["seed"] == 11
    assert first["data"][0]["b64_json"] == again["data"][0]["b64_json"]
    assert first["data"][0]["b64_json"] != other["data"][0]["b64_json"]


async def test_steps_are_clamped_to_the_spec_range(api, flux):
    body = await generate(api, size="256x256", seed=1, steps=0)
    assert body["hypnos_telemetry"]["engine"]["steps"] == 1


async def test_an_edit_and_a_variation_start_from_the_reference(api, flux):
    edited = await api.post(
        "/v1/images/edits",
        {"model": FLUX, "prompt": "a red roof", "image": reference(), "size": "256x256", "seed": "3"},
    )
    assert edited.status_code == 200, edited.content
    assert png(edited.json()["data"][0]).size == (256, 256)
    assert edited.json()["data"][0]["seed"] == 3
    varied = await api.post("/v1/images/variations", {"model": FLUX, "image": reference(), "size": "256x256", "n": "2"})
    assert varied.status_code == 200, varied.content
    assert len(varied.json()["data"]) == 2
    assert await wait_until(lambda: flux.tiers.leases(FLUX) == 0, 30)


async def test_a_client_that_leaves_stops_the_batch_after_the_current_image(api, flux):
    request = asyncio.ensure_future(
        post_json(api, "/v1/images/generations", {"model": FLUX, "prompt": "x", "n": 4, "size": "256x256"})
    )

    async def first_image_done() -> bool:
        job = await ImageJob.objects.filter(model=FLUX, state="running").afirst()
        return job is not None and job.images_done >= 1

    deadline = asyncio.get_running_loop().time() + 120
    while not await first_image_done():
        assert asyncio.get_running_loop().time() < deadline, "the batch did not start"
        await asyncio.sleep(0.05)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    job = await ImageJob.objects.filter(model=FLUX).alatest("created_at")
    while (job := await ImageJob.objects.aget(pk=job.pk)).state == "running":
        await asyncio.sleep(0.1)
    assert job.state == "cancelled" and job.images_done < 4
    assert await wait_until(lambda: flux.tiers.leases(FLUX) == 0, 60)


async def test_a_loaded_diffusion_model_serves_the_next_request_without_a_switch(api, flux):
    await generate(api, size="256x256", seed=1)
    again = await generate(api, size="256x256", seed=2)
    assert again["hypnos_telemetry"]["previous_tier"] == "tier1_gpu_vram"
    assert again["hypnos_telemetry"]["tier_switch_latency_ms"] == 0
