"""The inference worker. Importing it does not import any engine library."""

from __future__ import annotations

from inference.worker.core import Worker

# The embedded deployment's worker is inference.transport.runtime's (`runtime.embedded_worker()`).
__all__ = ["Worker"]
