"""The Celery tasks (hypnos_site/celery.py finds them here): thin wrappers that run a job's
coroutine (inference/jobs/documents.py, inference/jobs/images.py) to its end on an event loop of
their own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from celery import shared_task
from django.conf import settings

log = logging.getLogger(__name__)
JobRunner = Callable[[str, Any, Any], Awaitable[dict[str, Any] | None]]


@shared_task(name="hypnos.convert_document", ignore_result=False)
def convert_document(job_id: str) -> dict[str, Any] | None:
    """Convert the document of DocumentJob `job_id`; its result is the document with its pages
    (None when the job failed or was cancelled: its row says why)."""
    from inference.jobs.documents import run_job

    return asyncio.run(_run(run_job, job_id))


@shared_task(name="hypnos.make_images", ignore_result=False)
def make_images(job_id: str) -> dict[str, Any] | None:
    """Make the images of ImageJob `job_id`; its result is their seeds (None when the job
    failed or was cancelled: its row says why)."""
    from inference.jobs.images import run_job

    return asyncio.run(_run(run_job, job_id))


@shared_task(
    bind=True,
    name="hypnos.run_batch",
    ignore_result=False,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=None,
)
def run_batch(self: Any, batch_id: str) -> dict[str, Any] | None:
    """Run Batch `batch_id`'s lines (inference/jobs/batches.py); acknowledged when it ends, so a
    Celery worker that dies mid-batch leaves it to the next, which resumes after the last
    result written. A second delivery while a job still holds the batch waits for its hold."""
    from inference.jobs.batches import BatchHeld, run_job

    try:
        return asyncio.run(_run(run_job, batch_id))
    except BatchHeld as held:
        if settings.CELERY_TASK_ALWAYS_EAGER:  # embedded: the job that holds it is in this process
            return None
        raise self.retry(countdown=held.retry_in) from held


async def _run(run_job: JobRunner, job_id: str) -> dict[str, Any] | None:
    if settings.HYPNOS.server.deployment != "distributed":
        from inference.jobs.feed import local_channels
        from inference.transport.runtime import get_client

        return await run_job(job_id, get_client(), local_channels)
    # A channel layer of the task's own: channels-redis keeps per-event-loop state, and each
    # task runs on a new loop, several at once in one worker process.
    from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

    from inference.transport.client import ChannelLayerTransport, InferenceClient

    layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
    client = InferenceClient(ChannelLayerTransport(layer, settings.HYPNOS.server.worker_ack_timeout_secs))
    try:
        return await run_job(job_id, client, layer)
    finally:
        await layer.close_pools()


def resume_unfinished_batches(eager: bool) -> list[str]:
    """At start-up, the batches left unfinished run again, each skipping the lines whose results
    are written; their ids. Embedded (`eager`): on this process's job threads, the dead server's
    holds let go first (no other process runs them). A Celery worker: sent to the queue again
    (Redis gives a dead worker's unacknowledged task back only after its visibility timeout);
    one another live worker still runs waits for its hold (BatchHeld) and then finds it done."""
    from inference.jobs.feed import start_eager
    from logs.models import Batch

    unfinished = Batch.objects.filter(status__in=("in_progress", "cancelling", "finalizing"))
    ids = list(unfinished.values_list("id", flat=True))
    if eager:
        Batch.objects.filter(id__in=ids).update(lease_until=None)
    for batch_id in ids:
        log.info("resuming batch %s after a restart", batch_id)
        if eager:
            start_eager(run_batch, batch_id)
        else:
            run_batch.apply_async(args=(batch_id,), task_id=batch_id)
    return ids
