"""The image job (spec §11), run by the Celery task `make_images`: generations, edits, variations
and upscales.

It calls the inference worker through the process's InferenceClient like a view does; the
worker writes each image as a PNG in the job's output folder as soon as it is made, and the job
sends it to the waiting request at once, in pieces under the channel layer's message cap. The
job's row (logs.models.ImageJob) says how many images are done for the operator; a client that
left sets its cancel flag, and the job stops after the current step or image.

Nothing is left behind whatever the ending: the reference spool files and the output folder
are removed."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from django.utils import timezone
from pydantic import BaseModel, ConfigDict

from hypnos_site.errors import Cancelled, HypnosError, ModelNotAvailable, ServerError
from inference.jobs.feed import JobReporter, watched
from inference.transport.client import InferenceClient
from inference.transport.wire import IMAGE_PIECE_BYTES, Done, EngineRequest, ImageData, ImageReady, ImageWork
from logs.models import ImageJob

log = logging.getLogger(__name__)


class ImageJobSpec(BaseModel):
    """What the request asked for, as the web process hands it to the job (kept in the job row):
    the worker's work itself, and where the job reports."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    model: str
    request_id: str
    work: ImageWork
    progress_channel: str


async def run_job(job_id: str, client: InferenceClient, layer: Any) -> dict[str, Any] | None:
    """Run the job to its end, reporting on `layer` (inference/jobs/feed.py): `started`, each image's
    PNG, then `done` with the telemetry. The task's stored result is the images' seeds."""
    job = await ImageJob.objects.aget(pk=job_id)
    spec = ImageJobSpec.model_validate(job.spec)
    reporter = JobReporter(layer, spec.progress_channel)
    output = Path(spec.work.output_dir)
    try:
        if job.cancel_requested:
            raise Cancelled("the client left before the job started")
        await _set(job, state="running", started_at=timezone.now())
        done, seeds = await watched(ImageJob, job_id, _make(job, spec, client, reporter), reporter)
        # The row is final before the client hears the end.
        await _set(job, state="done", images_done=len(seeds), finished_at=timezone.now())
        await reporter.send(done)
        return {"seeds": seeds}
    except (asyncio.CancelledError, Cancelled):
        await _set(job, state="cancelled", finished_at=timezone.now())
        return None
    except Exception as exc:
        if await ImageJob.objects.filter(pk=job_id, cancel_requested=True).aexists():
            # The client left while the work failed (its references may be gone): cancelled.
            await _set(job, state="cancelled", finished_at=timezone.now())
            return None
        if isinstance(exc, HypnosError):
            error = exc
        else:
            log.exception("image job %s failed", job_id)
            error = ServerError(f"The image job failed: {type(exc).__name__}: {exc}")
        await _set(job, state="failed", error=error.message[:2000], finished_at=timezone.now())
        await reporter.error(error)
        return None
    finally:
        for path in spec.work.reference_paths:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(output, ignore_errors=True)


async def _make(
    job: ImageJob, spec: ImageJobSpec, client: InferenceClient, reporter: JobReporter
) -> tuple[Done, list[int | None]]:
    """Run the work on the inference worker, relaying `started` and each image as it is made."""
    request = EngineRequest(request_id=spec.request_id, model=spec.model, work=spec.work)
    call, started = await client.start(request)
    seeds: list[int | None] = []
    async with call:
        await reporter.send(started)
        async for event in call.events():
            if isinstance(event, ImageReady):
                await _relay(event, reporter)
                seeds.append(event.seed)
                await _set(job, images_done=len(seeds))
            elif isinstance(event, Done):
                return event, seeds
    raise ModelNotAvailable("the inference worker ended the image request without a result")


async def _relay(image: ImageReady, reporter: JobReporter) -> None:
    """The image's PNG to the waiting request in pieces, then its file removed."""
    path = Path(image.path)
    data = await asyncio.to_thread(path.read_bytes)
    path.unlink(missing_ok=True)
    pieces = range(0, max(len(data), 1), IMAGE_PIECE_BYTES)
    for start in pieces:
        last = start + IMAGE_PIECE_BYTES >= len(data)
        await reporter.send(
            ImageData(index=image.index, data=data[start : start + IMAGE_PIECE_BYTES], last=last, seed=image.seed)
        )


async def _set(job: ImageJob, **fields: Any) -> None:
    for name, value in fields.items():
        setattr(job, name, value)
    await job.asave(update_fields=list(fields))
