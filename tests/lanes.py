"""How the whole suite shares the machine's two cores (issue 31): two pytest-xdist workers, with
a memory weight per work unit and a budget for the two together.

`./run.sh test` runs the whole suite with `-n 2` (`HYPNOS_TEST_WORKERS`, 2 by default; 0 runs it
serially). A serial run leaves a core idle about 40 % of the time (a server
starting, a subprocess waited on, a browser), so two workers finish sooner;
but two of the suite's largest parts side by side (the end-to-end servers with their lineups,
the in-process 1.5B model) would take the machine past the 6 GB the suite may use. So:

- The end-to-end tests that use a shared server (tests/e2e/conftest.py: `embedded`, `keyed`,
  `distributed`) are a unit per server, run by one worker in the order a serial run has, so
  each server starts once and stops after its last test; the other end-to-end tests (each
  module starts its own servers) are one more unit. Every other module is a unit of its own:
  its module-scoped workers start once, and its tests keep their order.
- A unit weighs what `weight()` says: 3 for the shared embedded server's tests (its lineup and
  a headless Chromium: 4.8 GB of the machine in a serial run), 2 for the other end-to-end units
  and the in-process modules that load the 1.5B model or the advisor's server, 0 for a unit
  test module, 1 for any other module. A unit is handed to a worker only while its weight and
  that of the units the other worker holds (assigned or running) add up to at most BUDGET: the
  embedded server's tests run beside unit tests only, the other heavy units beside one light
  module.
- Among the units that fit, the heavy ones (2) go first, since their chain is what the run waits
  on; then the light modules (1) in collection order; then the embedded server's tests (3),
  which wait for the light modules to end; the unit tests (0) last, to run beside them.

The controller sees only test ids, so a worker tells it which server each end-to-end test uses
through a file (`publish()`, named by HYPNOS_TEST_UNITS_FILE, which `configure()` sets before
the workers start). (pytest-xdist's own `--dist loadgroup` cannot carry it: with pytest 9 the
group it writes into a test's id is lost.) Used when xdist distributes with its default
`--dist load` (`-n N`); another `--dist` keeps xdist's own scheduler, and a run without `-n` is
serial as before.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

E2E = "tests/e2e/"
EMBEDDED = "e2e-embedded"  # the unit of the shared embedded server's tests
BUDGET = 3
UNITS_FILE = "HYPNOS_TEST_UNITS_FILE"

# In-process modules measured holding 1.4-2.5 GB more than the pytest process (serial run, the
# machine's used memory).
HEAVY_IN_PROCESS = (
    "tests/integration/test_entities.py",
    "tests/integration/test_ollama.py",
    "tests/integration/test_advisor.py",
)


def configure(config: pytest.Config) -> None:
    """In the controller of a distributed run: the file the workers' units will be told in."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        fd, path = tempfile.mkstemp(prefix="hypnos-test-units-", suffix=".json")
        os.close(fd)
        os.environ[UNITS_FILE] = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


def publish(servers: dict[str, str]) -> None:
    """In the first worker, once its tests are in their running order: the shared server each
    end-to-end test that uses one uses (test id -> `embedded`, `keyed`, `distributed`)."""
    path = os.environ.get(UNITS_FILE)
    if path and os.environ.get("PYTEST_XDIST_WORKER") == "gw0":
        Path(path).write_text(json.dumps(servers))


class Budgeted(LoadScopeScheduling):
    """LoadScopeScheduling with _split_scope's units, two workers' units weighing at most BUDGET."""

    servers: dict[str, str] = {}

    def _split_scope(self, nodeid: str) -> str:
        """The unit of a test: its shared server's, else all end-to-end tests', else its module's."""
        if nodeid in self.servers:
            return "e2e-" + self.servers[nodeid]
        return E2E if nodeid.startswith(E2E) else nodeid.split("::", 1)[0]

    def weight(self, unit: str) -> int:
        # Without the servers (a run of other modules), the end-to-end unit holds them all.
        if unit == EMBEDDED or (unit == E2E and not self.servers):
            return 3
        if unit.startswith(("e2e-", E2E)) or unit in HEAVY_IN_PROCESS:
            return 2
        return 0 if unit.startswith("tests/unit/") else 1

    def schedule(self) -> None:
        if self.collection is None:  # the first call, every worker's collection in
            path = os.environ.get(UNITS_FILE)
            text = Path(path).read_text() if path and Path(path).exists() else ""
            self.servers = json.loads(text) if text else {}
            self.config.option.loadscopereorder = False  # the order is _next_unit's
        super().schedule()

    def _held_elsewhere(self, node: Any) -> int:
        """The weight of the heaviest unit another worker holds and has not finished."""
        return max(
            (
                self.weight(unit)
                for other, units in self.assigned_work.items()
                if other is not node
                for unit, tests in units.items()
                if not all(tests.values())
            ),
            default=0,
        )

    def _next_unit(self, node: Any) -> str | None:
        room = BUDGET - self._held_elsewhere(node)
        fitting = [unit for unit in self.workqueue if self.weight(unit) <= room]
        for weight in (2, 1, 3, 0):
            for unit in fitting:
                if self.weight(unit) == weight:
                    return unit
        if self.workqueue and all(self._pending_of(units) == 1 for units in self.assigned_work.values()):
            # xdist runs a worker's last test only once it knows what follows: two workers each
            # holding theirs for the other's unit to end would wait for ever. This one gets the
            # lightest unit left, over the budget for as long as the other's module lives.
            return min(self.workqueue, key=self.weight)
        return None

    def _assign_work_unit(self, node: Any) -> None:
        unit = self._next_unit(node)
        if unit is None:  # what is left does not fit beside the other worker's unit: wait
            return
        tests = self.workqueue.pop(unit)
        self.assigned_work.setdefault(node, {})[unit] = tests
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in tests.items() if not done])

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # A worker that was left waiting for room (holding its last test, which xdist runs only
        # once it knows what follows, or idle) is rescheduled here: none of its own tests will
        # complete to do it.
        for other in list(self.assigned_work):
            if other is not node:
                self._reschedule(other)
