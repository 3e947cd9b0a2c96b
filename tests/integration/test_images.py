"""The image routes (spec §11) on the real DCGAN face generator of the default lineup, run as
image jobs (eager Celery in the embedded deployment): PNGs of the model's size, seeds, the
same seed giving the same bytes, and every refusal with its status before any job runs or
from the worker's checks, with nothing left behind (lease, job, spool file)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from django.conf import settings
from PIL import Image

from inference.transport.deadline import within
from logs.models import ImageJob
from tests.fuzz.strategies import png_claiming
from tests.integration.conftest import post_json, wait_until, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
GAN, CHAT = "dcgan-faces", "smollm2-135m"
GENERATIONS, EDITS, VARIATIONS, UPSCALE = (
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/v1/images/upscale",
)


def png_of(width: int = 32, height: int = 32, noise: bool = False) -> bytes:
    out = io.BytesIO()
    if noise:
        pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        pixels = np.linspace(0, 255, width * height * 3).astype(np.uint8).reshape(height, width, 3)
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def decoded(item: dict) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert image.format == "PNG"
    return image


async def generate(api, **body) -> dict:
    response = await post_json(api, GENERATIONS, {"model": GAN, "prompt": "a face", **body})
    assert response.status_code == 200, response.content
    return response.json()


def assert_refused(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


async def assert_nothing_left(worker) -> None:
    assert await wait_until(lambda: worker.tiers.leases(GAN) == 0 and worker.tiers.leases("realesrgan-x4") == 0, 30)
    spool = settings.HYPNOS.data_dir / "spool"
    leftovers = [p for p in spool.rglob("*") if p.is_file()] if spool.exists() else []
    assert leftovers == []
    assert not await ImageJob.objects.filter(state__in=("queued", "running")).aexists()


async def test_a_generation_is_pngs_of_the_models_size_with_their_seeds(api, worker):
    body = await generate(api, n=2, seed=7, size="64x64")
    assert isinstance(body["created"], int)
    assert [item["seed"] for item in body["data"]] == [7, 8]
    for item in body["data"]:
        image = decoded(item)
        assert image.size == (64, 64) and image.mode == "RGB"
    telemetry = body["hypnos_telemetry"]
    assert telemetry["placement"]["primary_tier"] == "tier1_gpu_vram"
    assert telemetry["engine"]["images"] == 2 and telemetry["engine"]["width"] == 64
    job = await ImageJob.objects.aget(request_id__isnull=False, state="done", images_total=2)
    assert job.images_done == 2 and job.op == "generate"
    await assert_nothing_left(worker)


async def test_the_same_seed_gives_the_same_png_bytes_and_another_seed_another_image(api):
    first, again = await generate(api, seed=2718281828), await generate(api, seed=2718281828)
    other = await generate(api, seed=31)
    assert first["data"][0]["b64_json"] == again["data"][0]["b64_json"]
    assert first["data"][0]["b64_json"] != other["data"][0]["b64_json"]
    # The prompt seeds an unconditional generator too: another prompt, another face.
    reworded = await generate(api, seed=2718281828, prompt="another face")
    assert reworded["data"][0]["b64_json"] != first["data"][0]["b64_json"]
    # data[].seed sent back with the same prompt gives the same image (spec §11).
    batch = await generate(api, seed=40, n=3)
    third = await generate(api, seed=batch["data"][2]["seed"])
    assert third["data"][0]["b64_json"] == batch["data"][2]["b64_json"]


async def test_the_model_list_says_the_generator_ignores_the_prompt(api):
    listed = {m["id"]: m for m in (await api.get("/v1/models")).json()["data"]}
    assert listed[GAN]["modality"] == "image_generation"
    assert listed[GAN]["capabilities"] == ["images", "ignores_prompt"]
    assert "ignores_prompt" not in listed[CHAT]["capabilities"] and "images" not in listed[CHAT]["capabilities"]


async def test_a_random_seed_is_reported(api):
    body = await generate(api)
    assert isinstance(body["data"][0]["seed"], int) and body["data"][0]["seed"] >= 0


async def test_url_is_accepted_and_answered_as_base64(api):
    body = await generate(api, response_format="url", seed=1)
    assert decoded(body["data"][0]).size == (64, 64)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"size": "512x512"}, 400, "size"),
        ({"size": "0x0"}, 400, "size"),
        ({"size": "big"}, 400, "size"),
        ({"size": 64}, 400, "size"),
        ({"n": 0}, 400, "n"),
        ({"n": 5}, 400, "n"),
        ({"n": "2"}, 400, "n"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": None}, 400, "prompt"),
        ({"seed": -1}, 400, "seed"),
        ({"cfg_scale": "high"}, 400, "cfg_scale"),
        ({"response_format": "png"}, 400, "response_format"),
        ({"model": CHAT}, 400, "model"),
        ({"model": "no-such-model"}, 404, "model"),
    ],
)
async def test_bad_generation_requests_are_refused_naming_the_field(api, worker, body, status, param):
    response = await post_json(api, GENERATIONS, {"model": GAN, "prompt": "a face", **body})
    assert_refused(response, status, param)
    await assert_nothing_left(worker)


async def test_a_model_that_does_not_edit_refuses_edits_and_variations(api, worker):
    for route in (EDITS, VARIATIONS):
        response = await api.post(route, {"model": GAN, "prompt": "smile", "image": _upload(png_of())})
        error = assert_refused(response, 400, "model")
        assert "edit" in error["message"]
    await assert_nothing_left(worker)


@pytest.mark.parametrize(
    ("image", "status", "param"),
    [
        (b"not an image at all", 400, "image"),
        (png_of()[:40], 400, "image"),
        (png_claiming(20000, 20000), 400, "image"),
        (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", 400, "image"),
    ],
    ids=["text", "truncated_png", "bomb", "gif"],
)
async def test_bad_reference_images_are_refused(api, worker, image, status, param):
    response = await api.post(EDITS, {"model": GAN, "prompt": "smile", "image": _upload(image)})
    assert_refused(response, status, param)
    await assert_nothing_left(worker)


async def test_a_reference_above_max_image_bytes_is_a_400(api, worker, settings):
    with_limits(settings, max_image_bytes=1000)
    large = png_of(64, 64, noise=True)
    assert len(large) > 1000
    response = await api.post(EDITS, {"model": GAN, "prompt": "smile", "image": _upload(large)})
    assert_refused(response, 400, "image")
    assert response.json()["error"]["code"] == "payload_too_large"
    response = await post_json(api, UPSCALE, {"model": GAN, "image": base64.b64encode(large).decode()})
    assert_refused(response, 400, "image")
    await assert_nothing_left(worker)


async def test_a_mask_is_refused_and_an_edit_needs_an_image(api):
    response = await api.post(
        EDITS, {"model": GAN, "prompt": "smile", "image": _upload(png_of()), "mask": _upload(png_of())}
    )
    assert_refused(response, 400, "mask")
    assert_refused(await api.post(EDITS, {"model": GAN, "prompt": "smile"}), 400, "image")
    response = await post_json(api, EDITS, {"model": GAN, "prompt": "smile"})
    assert response.status_code in (400, 415)


async def test_a_generator_is_no_upscaler(api, worker):
    response = await post_json(api, UPSCALE, {"model": GAN, "image": base64.b64encode(png_of()).decode()})
    assert_refused(response, 400, "model")
    for image in ("!!!", "data:image/png,raw", base64.b64encode(b"text").decode()):
        assert_refused(await post_json(api, UPSCALE, {"model": GAN, "image": image}), 400, "image")
    await assert_nothing_left(worker)


def _upload(data: bytes, name: str = "ref.png") -> io.BytesIO:
    upload = io.BytesIO(data)
    upload.name = name
    return upload


async def test_an_image_model_and_a_chat_model_evict_each_other_under_a_tight_budget(api, settings, serve):
    """Each fits tier 1 alone, not both: every request evicts the other model, and both keep
    answering (the image model comes back from tier 2, its graph warm in a memfd)."""
    config = settings.HYPNOS
    models = [m.model_copy(update={"initial_tier": "tier3_nvme_ssd"}) for m in config.models if m.id in (GAN, CHAT)]
    roomy = serve(config.model_copy(update={"models": models}))
    await generate(api, seed=1)
    chat = {"model": CHAT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert (await post_json(api, "/v1/chat/completions", chat)).status_code == 200
    booked = {m: roomy.tiers.entries[m].tier1_bytes() for m in (GAN, CHAT)}
    assert all(booked.values()), booked
    roomy.shutdown()
    budget = max(booked.values()) + min(booked.values()) // 2
    tight = config.model_copy(
        update={"models": models, "hardware": config.hardware.model_copy(update={"simulated_vram_bytes": budget})}
    )
    serve(tight)
    first = await generate(api, seed=3)
    assert first["hypnos_telemetry"]["previous_tier"] == "tier3_nvme_ssd"
    answered = await post_json(api, "/v1/chat/completions", chat)
    assert answered.status_code == 200
    assert answered.json()["hypnos_telemetry"]["evicted_models"] == [GAN]
    again = await generate(api, seed=3)
    assert again["hypnos_telemetry"]["evicted_models"] == [CHAT]
    assert again["hypnos_telemetry"]["previous_tier"] == "tier2_pinned_ram"
    assert again["data"][0]["b64_json"] == first["data"][0]["b64_json"]


# -- upscaling (Real-ESRGAN on ncnn) -------------------------------------------------------------

UPSCALER = "realesrgan-x4"


def picture(width: int = 64, height: int = 64) -> Image.Image:
    """A test picture with edges and text (not noise: an upscaler's output is compared with it)."""
    from PIL import ImageDraw

    image = Image.new("RGB", (width, height), (235, 225, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height // 2), fill=(200, 40, 40), outline=(20, 20, 20))
    draw.rectangle((width // 2, height // 3, width - 4, height - 6), fill=(30, 90, 200))
    draw.text((4, height - 14), "Hi 42", fill=(0, 0, 0))
    return image


def as_b64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def psnr(a: Image.Image, b: Image.Image) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(10 * np.log10(255**2 / np.mean((x - y) ** 2)))


@pytest.mark.parametrize("factor", [2, 4])
async def test_an_upscale_is_the_same_picture_larger_and_not_a_plain_resize(api, worker, factor):
    source = picture()
    response = await post_json(api, UPSCALE, {"model": UPSCALER, "image": as_b64(source), "upscale_factor": factor})
    assert response.status_code == 200, response.content
    body = response.json()
    upscaled = decoded(body["data"][0])
    assert upscaled.size == (64 * factor, 64 * factor)
    assert psnr(upscaled, source.resize(upscaled.size, Image.Resampling.BICUBIC)) > 20
    for name in ("NEAREST", "BOX", "BILINEAR", "HAMMING", "BICUBIC", "LANCZOS"):
        assert psnr(upscaled, source.resize(upscaled.size, getattr(Image.Resampling, name))) < 38, name
    engine = body["hypnos_telemetry"]["engine"]
    assert engine["upscale_factor"] == factor and engine["megapixels_per_s"] > 0
    await assert_nothing_left(worker)


async def test_the_upscalers_own_factor_is_the_default_and_others_are_refused(api, worker):
    default = await post_json(api, UPSCALE, {"model": UPSCALER, "image": as_b64(picture(32, 24))})
    assert decoded(default.json()["data"][0]).size == (128, 96)
    for factor in (8, 0, "2"):
        response = await post_json(
            api, UPSCALE, {"model": UPSCALER, "image": as_b64(picture()), "upscale_factor": factor}
        )
        assert_refused(response, 400, "upscale_factor")
    await assert_nothing_left(worker)


async def test_an_upscaler_is_no_generator(api, worker):
    assert_refused(await post_json(api, GENERATIONS, {"model": UPSCALER, "prompt": "a face"}), 400, "model")
    await assert_nothing_left(worker)


async def test_an_upscale_beyond_the_pixel_cap_is_refused(api, worker, settings):
    with_limits(settings, max_image_pixels=100_000)
    response = await post_json(
        api, UPSCALE, {"model": UPSCALER, "image": as_b64(picture(100, 100)), "upscale_factor": 4}
    )
    error = assert_refused(response, 400, "image")
    assert "400x400" in error["message"]
    await assert_nothing_left(worker)


async def test_a_client_that_leaves_stops_the_job_between_tiles(api, worker):
    """A 768x768 picture at 4x is 36 tiles (5-40 s here, by the machine's load): the client
    leaves once the job holds the model, and the job ends cancelled long before the last tile."""
    request = asyncio.ensure_future(
        post_json(api, UPSCALE, {"model": UPSCALER, "image": as_b64(picture(768, 768)), "upscale_factor": 4})
    )
    assert await wait_until(lambda: worker.tiers.leases(UPSCALER) == 1, 60)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    job = await ImageJob.objects.filter(op="upscale").alatest("created_at")

    async def ended() -> ImageJob:
        while (found := await ImageJob.objects.aget(pk=job.pk)).state in ("queued", "running"):
            await asyncio.sleep(0.05)
        return found

    final = await within(ended(), 30)
    assert final.state == "cancelled" and final.cancel_requested and final.images_done == 0, (final.state, final.error)
    await assert_nothing_left(worker)


async def test_the_image_job_time_is_a_metric_family(api):
    await generate(api, seed=2)
    page = (await api.get("/metrics")).content.decode()
    counts = [line for line in page.splitlines() if line.startswith('hypnos_image_jct_s_count{model="dcgan-faces"}')]
    assert counts and float(counts[0].split()[-1]) >= 1
    assert 'hypnos_image_jct_s_bucket{le="+Inf",model="dcgan-faces"}' in page


async def test_a_failure_mid_batch_answers_the_error_not_a_partial_list(api, worker, monkeypatch):
    """The engine fails on the batch's third image: the answer is the error (500 in the
    envelope), no images, and nothing is left behind."""
    from inference.engines.image_onnx import OnnxImageEngine

    real = OnnxImageEngine.generate_image

    def failing(self, spec, cancel, on_step=None):
        if spec.seed == 102:
            raise RuntimeError("the generator broke")
        return real(self, spec, cancel, on_step)

    monkeypatch.setattr(OnnxImageEngine, "generate_image", failing)
    response = await post_json(api, GENERATIONS, {"model": GAN, "prompt": "a face", "n": 4, "seed": 100})
    assert response.status_code == 500, response.content
    body = response.json()
    assert "data" not in body and "the generator broke" in body["error"]["message"]
    job = await ImageJob.objects.filter(images_total=4).alatest("created_at")
    assert job.state == "failed" and job.images_done == 2
    await assert_nothing_left(worker)


async def test_a_loaded_image_model_serves_the_next_request_without_a_switch(api):
    await generate(api, seed=1)
    again = await generate(api, seed=2)
    assert again["hypnos_telemetry"]["previous_tier"] == "tier1_gpu_vram"
    assert again["hypnos_telemetry"]["tier_switch_latency_ms"] == 0
    upscale = {"model": UPSCALER, "image": as_b64(picture(32, 32)), "upscale_factor": 2}
    await post_json(api, UPSCALE, upscale)
    second = (await post_json(api, UPSCALE, upscale)).json()["hypnos_telemetry"]
    assert second["previous_tier"] == "tier1_gpu_vram" and second["tier_switch_latency_ms"] == 0
