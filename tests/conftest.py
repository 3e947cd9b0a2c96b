"""What the whole suite shares.

The in-process worker of the integration tests (tests/integration/conftest.py `worker`) holds
real engines; it is let go right after the last test of the run that uses it, so what it loaded
does not stay in the pytest process through the end-to-end modules, which run after it
(pytest-django runs the database tests first).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

PARIS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]

# tests/gpu (issue 20) is for a GPU: the suite's own collection (pytest's walk from tests/) leaves it
# out unless HYPNOS_GPU_TESTS=1 (`./run.sh gpu-check` sets it), since here it would only add skipped
# tests and CI skips none. Named on the command line (`pytest tests/gpu`) it is collected anyway.
collect_ignore = [] if os.environ.get("HYPNOS_GPU_TESTS") == "1" else ["gpu"]

_last_worker_user: list[str] = []
# .ci/run's memory sampler reads which test is running from this file, to say where the peak is.
_PROGRESS = os.environ.get("HYPNOS_CI_PROGRESS")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _PROGRESS:
        Path(_PROGRESS).write_text(nodeid)


@pytest.hookimpl(trylast=True)  # after pytest-django has put the tests in their running order
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "worker" in getattr(item, "fixturenames", ())]
    _last_worker_user[:] = users[-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if _last_worker_user and item.nodeid == _last_worker_user[0]:
            from inference.transport.runtime import runtime

            runtime.release()
