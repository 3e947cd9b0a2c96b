"""The Celery app of the long jobs (document conversion; ARCHITECTURE.md).

Distributed: `./run.sh jobs` starts `celery -A hypnos_site worker` on the Redis broker, and the
web processes send it jobs. Embedded: there is no broker and no Redis; the same tasks run eagerly
inside the server process (each on a thread of its own, inference/jobs/feed.py). Either way the task's
state and result are stored in the database through django-celery-results, and the task reaches
the inference worker through the process's InferenceClient, like a view."""

from __future__ import annotations

import logging
import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")

app = Celery("hypnos_site")
# The CELERY_* names of the Django settings (hypnos_site/settings.py).
app.config_from_object("django.conf:settings", namespace="CELERY")
# The tasks live in inference/jobs/tasks.py (the Celery worker's package), not an app's tasks.py.
app.autodiscover_tasks(["inference.jobs"])


@worker_ready.connect
def _resume_unfinished_batches(sender: object, **kwargs: object) -> None:
    """A Celery worker that starts takes up the batches a dead one left (inference/jobs/tasks.py)."""
    from django.db import DatabaseError

    from inference.jobs.tasks import resume_unfinished_batches

    try:
        resume_unfinished_batches(eager=False)
    except DatabaseError as exc:
        logging.getLogger("hypnos.batches").warning("unfinished batches not resumed: %s", exc)
