"""A worker shut down inside a process that goes on (the tests, a runtime.serving swap) leaves
none of its tier-2 memory behind: every warm copy (memfd) it made is closed."""

from __future__ import annotations

import os

import pytest

from inference.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def memfds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:hypnos:"):
            found.add(f"{fd} {target}")
    return found


def test_shutdown_closes_the_warm_copies(settings) -> None:  # type: ignore[no-untyped-def]
    before = memfds()
    config = settings.HYPNOS.model_copy(
        update={
            "models": [m.model_copy(update={"initial_tier": "tier2_pinned_ram"}) for m in settings.HYPNOS.models[:1]]
        }
    )
    worker = Worker(config)
    worker.start()
    assert worker.wait_ready(60)
    held = memfds() - before
    assert held, "the tier-2 model holds no warm copy"
    worker.shutdown()
    assert memfds() - before == set()
