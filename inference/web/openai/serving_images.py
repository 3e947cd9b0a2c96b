"""The image routes (spec §11, compat.md): generations, edits and variations (multipart, as the
OpenAI SDKs send them) and Lemonade's upscale. Each request is an image job run by Celery
(inference/jobs/images.py); this module checks the request, spools the reference images, hands
the job over and answers once every image is made.

Every refusal has its status: the fields, the model and the uploads (format, size, pixels) are
checked here; the job's first event (`started`, once the worker has checked the request
against the model) or its error decides the rest. A failure mid-batch is the error, never a
partial list. A client that leaves sets the job's cancel flag: the worker stops after its
current step or image."""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase, JsonResponse

from hypnos_site.errors import TOO_LARGE, InvalidRequest, ModelNotAvailable
from inference.jobs import feed as jobs
from inference.jobs.images import ImageJobSpec
from inference.transport.client import InferenceClient
from inference.transport.wire import Done, ImageData, ImageWork, Started
from inference.web.common import image_input
from inference.web.common.context import RequestContext, resolve_model
from inference.web.common.protocol import parse_body
from inference.web.openai.protocol_media import MAX_SEED, ImageGenerationRequest, ImageUpscaleRequest
from logs.models import ImageJob

# What the edit and variation routes take as references (spec §11).
REFERENCE_FORMATS = ("PNG", "JPEG", "WEBP")
FORM_FIELDS = ("model", "prompt", "negative_prompt", "size", "response_format")
FORM_INTS = ("n", "steps", "seed")
FORM_FLOATS = ("cfg_scale",)


async def create_images(
    client: InferenceClient, data: Any, ctx: RequestContext, owner: str | None, op: str
) -> HttpResponseBase:
    """POST /v1/images/generations (JSON), /v1/images/edits and /v1/images/variations (multipart)."""
    if op == "generate":
        if not isinstance(data, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        body = parse_body(ImageGenerationRequest, dict(data))
        uploads: list[Any] = []
    else:
        body, uploads = _form_request(data, op)
    limits = settings.HYPNOS.limits
    if body.n > limits.max_images_per_request:
        raise InvalidRequest(
            f"n is {body.n}; at most {limits.max_images_per_request} images per request "
            "(limits.max_images_per_request).",
            param="n",
        )
    size = body.dimensions()
    model = await _image_model(client, body.model, ctx)
    references = await _spool_uploads(uploads, ctx.request_id)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
    fields = dict(
        op=op,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt or "",
        n=body.n,
        width=size[0] if size else None,
        height=size[1] if size else None,
        steps=body.steps,
        cfg_scale=body.cfg_scale,
        seed=min(seed, MAX_SEED - body.n),
        reference_paths=[str(p) for p in references],
    )
    return await _run(model, fields, references, ctx, owner, body.n)


async def upscale_image(client: InferenceClient, data: Any, ctx: RequestContext, owner: str | None) -> HttpResponseBase:
    """POST /v1/images/upscale: `{model, image (base64 PNG or a data: URI), upscale_factor}`."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    body = parse_body(ImageUpscaleRequest, dict(data))
    image = _decode_base64(body.image)
    _check_reference(image, "image")
    model = await _image_model(client, body.model, ctx)
    references = await _spool([image], ctx.request_id)
    fields = dict(op="upscale", upscale_factor=body.upscale_factor, reference_paths=[str(p) for p in references])
    return await _run(model, fields, references, ctx, owner, 1)


async def _image_model(client: InferenceClient, name: str, ctx: RequestContext) -> str:
    model = await resolve_model(client, name, ctx)
    ctx.record.work = "image"
    if model.modality != "image_generation":
        raise InvalidRequest(f"The model {model.id!r} serves {model.modality}, not image_generation.", param="model")
    return model.id


async def _run(
    model: str, fields: dict[str, Any], references: list[Path], ctx: RequestContext, owner: str | None, n: int
) -> JsonResponse:
    """Hand the job to Celery, wait for its images, and answer them (or its error)."""
    job_id = "img-" + uuid.uuid4().hex
    work = ImageWork(
        output_dir=str(settings.HYPNOS.data_dir / "spool" / "images" / job_id),
        max_pixels=settings.HYPNOS.limits.max_image_pixels,
        **fields,
    )

    async def create_row(channel: str) -> None:
        spec = ImageJobSpec(model=model, request_id=ctx.request_id, work=work, progress_channel=channel)
        await ImageJob.objects.acreate(
            id=job_id,
            request_id=ctx.request_id,
            model=model,
            op=work.op,
            owner=owner or "",
            spec=spec.model_dump(),
            images_total=n,
        )

    from inference.jobs.tasks import make_images

    feed, _started = await jobs.start(ImageJob, job_id, make_images, create_row, Started, references)
    pieces: dict[int, list[bytes]] = {}
    seeds: dict[int, int | None] = {}
    done: Done | None = None
    async with aclosing(jobs.job_events(feed, ImageJob, job_id, ctx.record)) as events:
        async for event in events:
            if isinstance(event, ImageData):
                pieces.setdefault(event.index, []).append(event.data)
                seeds[event.index] = event.seed
            elif isinstance(event, Done):
                done = event
    if done is None:
        raise ModelNotAvailable("the image job ended without its images")
    data = []
    for index in sorted(pieces):
        item: dict[str, Any] = {"b64_json": base64.b64encode(b"".join(pieces[index])).decode()}
        if seeds[index] is not None:
            item["seed"] = seeds[index]
        data.append(item)
    return JsonResponse({"created": int(time.time()), "data": data, "hypnos_telemetry": done.telemetry})


def _form_request(data: Any, op: str) -> tuple[ImageGenerationRequest, list[Any]]:
    """The fields of a multipart edit or variation and its reference images (`image` and
    `image[]` parts); `mask` is refused, since no model here inpaints."""
    if not hasattr(data, "getlist"):
        raise InvalidRequest("This route takes multipart/form-data, as the OpenAI SDKs send it.")
    if data.get("mask") is not None:
        raise InvalidRequest(
            "mask is not supported: the models here edit from the prompt and the references, not by inpainting.",
            param="mask",
        )
    fields: dict[str, Any] = {k: data.get(k) for k in FORM_FIELDS if isinstance(data.get(k), str) and data.get(k)}
    for name in FORM_INTS:
        fields.update(_form_number(data, name, int))
    for name in FORM_FLOATS:
        fields.update(_form_number(data, name, float))
    if op == "variation":
        # A variation has no prompt: the reference is the whole instruction.
        fields.setdefault("prompt", " ")
    uploads = [part for key in ("image", "image[]") for part in data.getlist(key) if hasattr(part, "read")]
    if not uploads:
        raise InvalidRequest("image is required: the picture to start from, as a file part.", param="image")
    if op == "variation" and len(uploads) > 1:
        raise InvalidRequest("A variation takes one image.", param="image")
    limit = settings.HYPNOS.limits.max_images_per_request
    if len(uploads) > limit:
        raise InvalidRequest(f"At most {limit} reference images (limits.max_images_per_request).", param="image")
    return parse_body(ImageGenerationRequest, fields), uploads


def _form_number(data: Any, name: str, kind: type) -> dict[str, Any]:
    value = data.get(name)
    if value is None or value == "":
        return {}
    try:
        number = kind(str(value).strip())
    except ValueError:
        raise InvalidRequest(f"{name} must be a number, not {str(value)[:40]!r}.", param=name) from None
    if kind is float and number != number:  # NaN
        raise InvalidRequest(f"{name} must be a number, not NaN.", param=name)
    return {name: number}


async def _spool_uploads(uploads: list[Any], request_id: str) -> list[Path]:
    """Each reference checked (PNG, JPEG or WebP, at most max_image_bytes, at most
    max_image_pixels) and spooled for the job."""
    limit = settings.HYPNOS.limits.max_image_bytes
    images = []
    for upload in uploads:
        if upload.size > limit:
            raise _too_large(upload.size, limit)
        data = await asyncio.to_thread(upload.read)
        _check_reference(data, "image")
        images.append(data)
    return await _spool(images, request_id)


def _check_reference(data: bytes, param: str) -> None:
    limits = settings.HYPNOS.limits
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits.max_image_bytes)
    if not data:
        raise InvalidRequest(f"{param} is empty (0 bytes).", param=param)
    found = image_input.check_image(data, limits.max_image_pixels, param=param)
    if found not in REFERENCE_FORMATS:
        raise InvalidRequest(f"{param} must be PNG, JPEG or WebP, not {found}.", param=param)


async def _spool(images: list[bytes], request_id: str) -> list[Path]:
    spool = settings.HYPNOS.data_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        for image in images:
            path = spool / f"{request_id}-{uuid.uuid4().hex[:8]}.image"
            await asyncio.to_thread(path.write_bytes, image)
            paths.append(path)
    except BaseException:
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return paths


def _decode_base64(text: str) -> bytes:
    """`image` in JSON: base64, or a data: URI holding base64."""
    payload = text
    if text.startswith("data:"):
        header, comma, payload = text[len("data:") :].partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise InvalidRequest("image as a data: URI must be base64 (data:<type>;base64,<data>).", param="image")
    limit = settings.HYPNOS.limits.max_image_bytes
    if len(payload) * 3 // 4 > limit + 3:
        raise _too_large(len(payload) * 3 // 4, limit)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image is not valid base64 (nor a data: URI holding base64).", param="image") from None


def _too_large(size: int, limit: int) -> InvalidRequest:
    """Spec §1: a limit of the section exceeded is a 400 (the 413 is max_body_bytes's alone)."""
    return InvalidRequest(
        f"The image is {size} bytes, above limits.max_image_bytes ({limit}).", param="image", code=TOO_LARGE
    )
