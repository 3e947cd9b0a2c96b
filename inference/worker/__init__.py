"""The inference worker. Importing it does not import any engine library."""

from __future__ import annotations

import atexit
import threading

from hypnos_site.config import HypnosConfig
from inference.worker.core import Worker

_worker: Worker | None = None
_worker_lock = threading.Lock()


def get_embedded_worker(config: HypnosConfig | None = None) -> Worker:
    """The in-process worker of the embedded deployment, created and started on first use
    (with `config`, default the settings' own)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            from django.conf import settings

            _worker = Worker(config or settings.HYPNOS)
            _worker.start()
            # Free the engines before the interpreter tears down the modules they need.
            atexit.register(_worker.shutdown)
        return _worker


__all__ = ["Worker", "get_embedded_worker"]
