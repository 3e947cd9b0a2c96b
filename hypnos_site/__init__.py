__version__ = "0.1.0"

# Celery's Django pattern: the app exists whenever Django does, so @shared_task binds to it.
from hypnos_site.celery import app as celery_app  # noqa: E402

__all__ = ["__version__", "celery_app"]
