"""The worker's image operations (spec §11): generations, edits and variations (img2img from the
references) and upscaling, each image a PNG in the work's output_dir as soon as it is made.

Everything that can refuse the request is checked before `started`: the model's modality and
abilities (an edit needs `[models.image] edit = true`, an upscale an upscaler), the size (a
generator of one size refuses another; a diffusion size is clamped to 256..2048 and rounded down
to 16), the upscale factor, and the references, which are decoded here (their headers were
checked by the web process; the pixel cap is checked again before any decoding). After that a
batch ends early only when it is cancelled (the client left: the engine stops after its current
step or image) or the engine fails."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from hypnos_site.config import ImageConfig, ModelConfig
from hypnos_site.errors import Cancelled, InvalidRequest
from inference.engines.base import ImageSpec
from inference.transport.wire import Done, ImageReady, ImageStep, ImageWork, Started

if TYPE_CHECKING:
    from inference.engines.base import Engine
    from inference.worker.runtime import Lease, ModelRuntime
    from inference.worker.tier_moves import TierMoves

MIN_SIDE, MAX_SIDE, SIDE_STEP = 256, 2048, 16
MIN_STEPS, MAX_STEPS = 1, 100
MAX_CFG_SCALE = 30.0


def check_image_model(config: ModelConfig) -> None:
    if config.modality != "image_generation":
        raise InvalidRequest(
            f"The model {config.id!r} serves {config.modality}, not image_generation (/v1/images).", param="model"
        )


def clamp_side(value: int) -> int:
    """A diffusion image's side: clamped to 256..2048, rounded down to a multiple of 16."""
    return max(MIN_SIDE, min(MAX_SIDE, value)) // SIDE_STEP * SIDE_STEP


@dataclass
class _Plan:
    width: int
    height: int
    steps: int | None
    cfg_scale: float | None
    strength: float
    references: list[np.ndarray]
    # The upscale factor (0 for the other ops).
    factor: int = 0


def serve_images(
    moves: TierMoves,
    runtime: ModelRuntime,
    engine: Engine,
    work: ImageWork,
    lease: Lease,
    sink: Any,
    queue_ms: float,
) -> Done:
    """Bring the model to tier 1, check the request against it, make the images one by one (an
    `image_ready` event each), and return the terminal `done` with the spec's telemetry (§5)."""
    try:
        switch = moves.ensure_tier1(runtime, runtime.config.context_len)
        plan = _plan(runtime.config, engine, work)
    finally:
        for path in work.reference_paths:
            Path(path).unlink(missing_ok=True)
    sink(Started(previous_tier=str(switch.previous_tier)))
    output = Path(work.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    steps_done = 0
    with lease.generating():
        if work.op == "upscale":
            image = engine.upscale_image(plan.references[0], plan.factor, lease.cancel)
            sink(_write(output, 0, image, None))
        else:
            for index in range(work.n):
                if lease.cancel.is_set():
                    raise Cancelled("the request was cancelled")
                seed = work.seed + index

                def on_step(step: int, steps: int, index: int = index) -> None:
                    nonlocal steps_done
                    steps_done += 1
                    sink(ImageStep(index=index, step=step, steps=steps))

                spec = ImageSpec(
                    prompt=work.prompt,
                    negative_prompt=work.negative_prompt,
                    width=plan.width,
                    height=plan.height,
                    steps=plan.steps,
                    cfg_scale=plan.cfg_scale,
                    seed=seed,
                    references=plan.references,
                    strength=plan.strength,
                )
                sink(_write(output, index, engine.generate_image(spec, lease.cancel, on_step), seed))
    inference_ms = (time.perf_counter() - started) * 1000
    images = 1 if work.op == "upscale" else work.n
    timings: dict[str, Any] = {
        "queue_ms": round(queue_ms, 1),
        "images": images,
        "ms_per_image": round(inference_ms / images, 1),
    }
    if work.op == "upscale":
        height, width = plan.references[0].shape[:2]
        timings["upscale_factor"] = plan.factor
        timings["megapixels_per_s"] = round(width * height * plan.factor**2 / 1e6 / (inference_ms / 1000), 3)
    else:
        timings.update(width=plan.width, height=plan.height)
        if plan.steps is not None:
            timings.update(steps=plan.steps, cfg_scale=plan.cfg_scale, steps_done=steps_done)
    placement = moves.tiers.placement(runtime.config.id)
    telemetry = switch.telemetry(placement, inference_ms, timings)
    if switch.phases:
        telemetry["tier_switch_phases"] = switch.phases.as_dict()
    return Done(telemetry=telemetry)


def _plan(config: ModelConfig, engine: Engine, work: ImageWork) -> _Plan:
    """The request checked against the model: what the engine is asked, or a 400 naming the field."""
    image = config.image or ImageConfig()
    abilities = engine.capabilities()
    upscaler = "upscale" in abilities
    if work.op == "upscale":
        if not upscaler:
            raise InvalidRequest(f"The model {config.id!r} is not an upscaler.", param="model")
        factors = engine.upscale_factors()
        factor = work.upscale_factor or max(factors)
        if factor not in factors:
            raise InvalidRequest(
                f"The model {config.id!r} upscales by {', '.join(map(str, factors))}, not {factor}.",
                param="upscale_factor",
            )
        references = [_decode(path, work.max_pixels, "image") for path in work.reference_paths[:1]]
        if not references:
            raise InvalidRequest("image is required.", param="image")
        height, width = references[0].shape[:2]
        if width * height * factor**2 > work.max_pixels:
            raise InvalidRequest(
                f"The upscaled image would be {width * factor}x{height * factor} pixels, above "
                f"limits.max_image_pixels ({work.max_pixels}).",
                param="image",
            )
        return _Plan(0, 0, None, None, 0.0, references, factor)
    if upscaler:
        raise InvalidRequest(f"The model {config.id!r} is an upscaler: use /v1/images/upscale.", param="model")
    if work.op in ("edit", "variation") and not image.edit:
        raise InvalidRequest(
            f"The model {config.id!r} does not edit images ([models.image] edit = true); "
            f"/v1/images/{'edits' if work.op == 'edit' else 'variations'} needs one that does.",
            param="model",
        )
    fixed = engine.image_size()
    if fixed is not None:
        if work.width is not None and (work.width, work.height) != fixed:
            raise InvalidRequest(
                f"The model {config.id!r} makes {fixed[0]}x{fixed[1]} images only, not {work.width}x{work.height}.",
                param="size",
            )
        width, height = fixed
    else:
        width = clamp_side(work.width or 1024)
        height = clamp_side(work.height or 1024)
    steps: int | None = min(max(work.steps if work.steps is not None else image.steps, MIN_STEPS), MAX_STEPS)
    cfg: float | None = min(max(work.cfg_scale if work.cfg_scale is not None else image.cfg_scale, 0.0), MAX_CFG_SCALE)
    if "ignores_prompt" in abilities:
        # An unconditional generator samples nothing: no steps, no guidance.
        steps = cfg = None
    references = [_decode(path, work.max_pixels, "image") for path in work.reference_paths]
    if work.op in ("edit", "variation") and not references:
        raise InvalidRequest("image is required.", param="image")
    return _Plan(width, height, steps, cfg, image.strength, references)


def _decode(path: str, max_pixels: int, param: str) -> np.ndarray:
    """A reference image as RGB uint8 [H, W, 3]; 400 for what is no image or too many pixels."""
    data = Path(path).read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > max_pixels:
                raise InvalidRequest(
                    f"The image declares {width}x{height} pixels, above limits.max_image_pixels ({max_pixels}).",
                    param=param,
                )
            return np.asarray(opened.convert("RGB"), dtype=np.uint8)
    except InvalidRequest:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"The image cannot be decoded: {exc}.", param=param) from None


def _write(output: Path, index: int, image: np.ndarray, seed: int | None) -> ImageReady:
    """The image as a PNG in the output folder (Pillow's encoder: the same pixels give the same
    bytes)."""
    path = output / f"{index}.png"
    picture = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), "RGB")
    picture.save(path, format="PNG")
    return ImageReady(index=index, path=str(path), seed=seed)
