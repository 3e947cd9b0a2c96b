"""How the whole suite shares the machine's two cores (issue 31): two pytest-xdist workers, and
never two memory-heavy work units at once.

`./run.sh test` runs the whole suite with `-n 2`. A serial run leaves a core idle about 40 % of
the time (a server starting, a subprocess waited on, a browser), so two workers finish sooner;
but two of the suite's largest parts side by side (the end-to-end servers with their lineups,
the in-process 1.5B model) would take the machine past the 6 GB the suite may use. So:

- The end-to-end tests are one work unit, run by one worker in the order a serial run has
  (tests/e2e/conftest.py groups them by the shared server they use, and stops each server after
  its last test): one lineup of servers at a time, as in a serial run.
- Every other module is a unit of its own: its module-scoped workers start once, and its tests
  keep their order.
- A heavy unit (`heavy()`: the end-to-end tests, and the in-process modules that hold more than
  a few hundred MB: the 1.5B model, the advisor's server) is handed to a worker only while the
  other worker holds no heavy unit, assigned or running; light modules fill the other worker
  meanwhile.
- Heavy units are handed out first, the end-to-end unit before all, since their chain is what
  the run waits on; light modules follow in collection order.

Used when pytest-xdist distributes with its default `--dist load` (`-n N`); another `--dist`
keeps xdist's own scheduler, and a run without `-n` is serial as before.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

E2E = "tests/e2e/"

# In-process modules measured holding 1.4-2.5 GB more than the pytest process (serial run, the
# machine's used memory): kept apart from the end-to-end tests and from each other.
HEAVY_IN_PROCESS = (
    "tests/integration/test_entities.py",
    "tests/integration/test_ollama.py",
    "tests/integration/test_advisor.py",
)


def unit_of(nodeid: str) -> str:
    """The work unit of a test: all end-to-end tests together, else its module."""
    return E2E if nodeid.startswith(E2E) else nodeid.split("::", 1)[0]


def heavy(unit: str) -> bool:
    return unit == E2E or unit in HEAVY_IN_PROCESS


class HeavyApart(LoadScopeScheduling):
    """LoadScopeScheduling with unit_of's units, heavy units one at a time and first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def schedule(self) -> None:
        self.config.option.loadscopereorder = False  # the order is _next_unit's
        super().schedule()

    def _heavy_elsewhere(self, node: Any) -> bool:
        return any(
            heavy(unit) and not all(tests.values())
            for other, units in self.assigned_work.items()
            if other is not node
            for unit, tests in units.items()
        )

    def _next_unit(self, node: Any) -> str | None:
        queued = list(self.workqueue)
        if not self._heavy_elsewhere(node):
            for unit in (E2E, *HEAVY_IN_PROCESS):
                if unit in self.workqueue:
                    return unit
        return next((unit for unit in queued if not heavy(unit)), None)

    def _assign_work_unit(self, node: Any) -> None:
        unit = self._next_unit(node)
        if unit is None:  # only heavy units left, and the other worker is on one: wait
            return
        tests = self.workqueue.pop(unit)
        self.assigned_work.setdefault(node, {})[unit] = tests
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in tests.items() if not done])

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # A worker that was left waiting for a heavy unit to finish elsewhere (holding its last
        # test, which xdist runs only once it knows what follows, or idle) is rescheduled here:
        # none of its own tests will complete to do it.
        for other in list(self.assigned_work):
            if other is not node:
                self._reschedule(other)
