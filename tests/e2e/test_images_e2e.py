"""The image routes through the official `openai` SDK, unchanged, against both deployments (the
distributed one runs each image job on a real Celery worker over Redis, calling runinference
through the channel layer): the DCGAN face generator's PNGs, seeds and refusals."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
GAN = "dcgan-faces"


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def png(image_b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(image_b64)))
    assert image.format == "PNG"
    return image


def test_images_generate_through_the_sdk(server):
    client = sdk(server)
    result = client.images.generate(
        model=GAN, prompt="a face", n=2, size="64x64", response_format="b64_json", extra_body={"seed": 7}
    )
    assert [png(item.b64_json).size for item in result.data] == [(64, 64), (64, 64)]
    assert [item.model_extra["seed"] for item in result.data] == [7, 8]
    assert result.model_extra["hypnos_telemetry"]["engine"]["images"] == 2
    again = client.images.generate(model=GAN, prompt="a face", size="64x64", extra_body={"seed": 8})
    # data[].seed sent back gives the same image, byte for byte.
    assert again.data[0].b64_json == result.data[1].b64_json


def test_the_sdk_sees_the_routes_refusals(server):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=GAN, prompt="a face", size="1024x1024")
    assert refused.value.body["param"] == "size"
    reference = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 30, 200)).save(reference, "PNG")
    for call in (
        lambda: client.images.edit(model=GAN, prompt="smile", image=("ref.png", reference.getvalue(), "image/png")),
        lambda: client.images.create_variation(model=GAN, image=("ref.png", reference.getvalue(), "image/png")),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.body["param"] == "model"


def test_a_generated_face_upscaled_over_raw_http(server):
    face = sdk(server).images.generate(model=GAN, prompt="a face", size="64x64", extra_body={"seed": 3})
    response = httpx.post(
        f"{server.base_url}/v1/images/upscale",
        json={"model": "realesrgan-x4", "image": face.data[0].b64_json, "upscale_factor": 2},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert png(body["data"][0]["b64_json"]).size == (128, 128)
    assert body["hypnos_telemetry"]["engine"]["upscale_factor"] == 2
