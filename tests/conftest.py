"""What the whole suite shares.

The in-process worker of the integration tests (tests/integration/conftest.py `worker`) holds
real engines; it is let go before an end-to-end module (and at the end), so what it loaded does
not stay in the pytest process beside that module's servers. A later in-process test starts a
new one.

`./run.sh test` runs the whole suite on two pytest-xdist workers (HYPNOS_TEST_WORKERS, 2 by
default; 0: serially), scheduled by tests/lanes.py.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PARIS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]

# tests/gpu (issue 20) is for a GPU: the suite's own collection (pytest's walk from tests/) leaves it
# out unless HYPNOS_GPU_TESTS=1 (`./run.sh gpu-check` sets it), since here it would only add skipped
# tests and CI skips none. Named on the command line (`pytest tests/gpu`) it is collected anyway.
collect_ignore = [] if os.environ.get("HYPNOS_GPU_TESTS") == "1" else ["gpu"]

# .ci/run's memory sampler reads which tests are running from these files (one per xdist
# worker), to say where the peak is.
_PROGRESS = os.environ.get("HYPNOS_CI_PROGRESS")
if _PROGRESS and os.environ.get("PYTEST_XDIST_WORKER"):
    _PROGRESS += "." + os.environ["PYTEST_XDIST_WORKER"]


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _PROGRESS:
        Path(_PROGRESS).write_text(nodeid + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units within a memory budget (tests/lanes.py) for xdist's default `--dist load`;
    another `--dist` keeps xdist's own scheduler."""
    if config.getoption("dist") != "load":
        return None
    from tests.lanes import Budgeted

    return Budgeted(config, log)


def pytest_configure(config: pytest.Config) -> None:
    from tests import lanes

    lanes.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The in-process tests' data_dir (tests/settings.py) goes with the process."""
    from django.conf import settings

    if settings.configured and getattr(settings, "HYPNOS_TEST_DATA_DIR", None):
        shutil.rmtree(settings.HYPNOS_TEST_DATA_DIR, ignore_errors=True)


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A report an xdist worker sends is UTF-8 only (execnet): the fuzz tests' lone surrogates,
    in a captured log or a failure's text, are written as escapes instead of crashing the run."""
    report: pytest.TestReport = yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        report.sections = [(title, _utf8(text)) for title, text in report.sections]
        if report.longrepr is not None:
            text = str(report.longrepr)
            if _utf8(text) != text:
                report.longrepr = _utf8(text)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        e2e = "tests/e2e/"
        if nextitem is None or (nextitem.nodeid.startswith(e2e) and not item.nodeid.startswith(e2e)):
            from inference.transport.runtime import runtime

            runtime.release()
