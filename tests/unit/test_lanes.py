"""The suite's scheduler over two xdist workers (tests/lanes.py), driven the way pytest-xdist
drives it: every test runs once, a shared server's tests run whole on one worker in order, the
two workers' units stay within the memory budget, and no order of completions leaves both
workers waiting for each other (xdist runs a worker's last test only once it knows what
follows)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import lanes


class FakeWorker:
    """A worker as the scheduler sees it: the tests sent to it, run one at a time."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        assert not self.shutting_down
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def can_run(self) -> bool:
        # xdist's worker loop: a test runs once the next one is known, or the worker is told to end.
        return len(self.queue) >= 2 or (len(self.queue) == 1 and self.shutting_down)


def ids_of(module: str, count: int, param: str = "") -> list[str]:
    return [f"{module}::test_{i}{param}" for i in range(count)]


COLLECTION = [
    *ids_of("tests/integration/test_a.py", 3),
    *ids_of("tests/integration/test_b.py", 4),
    *ids_of("tests/integration/test_entities.py", 3),
    *ids_of("tests/integration/test_c.py", 2),
    *ids_of("tests/e2e/test_chat.py", 3, "[embedded]"),
    *ids_of("tests/e2e/test_sdk.py", 2, "[embedded]"),
    *ids_of("tests/e2e/test_keys.py", 2),
    *ids_of("tests/e2e/test_workers.py", 3),
    *ids_of("tests/e2e/test_chat.py", 3, "[distributed]"),
    *ids_of("tests/unit/test_x.py", 2),
    *ids_of("tests/unit/test_y.py", 3),
    *ids_of("tests/unit/test_z.py", 1),
]
SERVERS = {
    **{nodeid: "embedded" for nodeid in COLLECTION if nodeid.endswith("[embedded]")},
    **{nodeid: "keyed" for nodeid in COLLECTION if "test_keys" in nodeid},
    **{nodeid: "distributed" for nodeid in COLLECTION if nodeid.endswith("[distributed]")},
}


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, servers: dict[str, str]) -> dict[str, Any]:
    """Drive the scheduler to the end, completing runnable tests in a random order; returns
    which worker ran each test, in what order, and the heaviest pair of units held at once."""
    path = tmp_path / "units.json"
    monkeypatch.setenv(lanes.UNITS_FILE, str(path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    lanes.publish(servers)
    config = SimpleNamespace(
        getvalue=lambda name: {"tx": ["2*popen"], "dist": "load"}[name],
        option=SimpleNamespace(loadscopereorder=True),
    )
    scheduler = lanes.Budgeted(config)  # type: ignore[arg-type]
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)  # type: ignore[arg-type]
    for worker in workers:
        scheduler.add_node_collection(worker, COLLECTION)  # type: ignore[arg-type]
    scheduler.schedule()
    chance = random.Random(seed)
    ran: dict[str, str] = {}
    order: list[str] = []
    heaviest = 0
    while True:
        held = [
            max(
                (scheduler.weight(unit) for unit, tests in units.items() if not all(tests.values())),
                default=0,
            )
            for units in scheduler.assigned_work.values()
        ]
        heaviest = max(heaviest, sum(held))
        runnable = [worker for worker in workers if worker.can_run()]
        if not runnable:
            if scheduler.tests_finished:
                for worker in workers:
                    worker.shutdown()
                if not any(worker.can_run() for worker in workers):
                    break
                continue
            raise AssertionError(f"both workers wait: {[w.queue for w in workers]}")
        worker = chance.choice(runnable)
        index = worker.queue.pop(0)
        nodeid = COLLECTION[index]
        assert nodeid not in ran, f"{nodeid} ran twice"
        ran[nodeid] = worker.gateway.id
        order.append(nodeid)
        scheduler.mark_test_complete(worker, index)  # type: ignore[arg-type]
    return {"ran": ran, "order": order, "heaviest": heaviest}


@pytest.mark.parametrize("seed", range(20))
def test_every_test_runs_once_within_the_budget_and_each_server_whole_on_one_worker(tmp_path, monkeypatch, seed):
    result = run(tmp_path, monkeypatch, seed, SERVERS)
    assert sorted(result["ran"]) == sorted(COLLECTION)
    assert result["heaviest"] <= lanes.BUDGET
    for server in ("embedded", "keyed", "distributed"):
        tests = [nodeid for nodeid in COLLECTION if SERVERS.get(nodeid) == server]
        assert len({result["ran"][nodeid] for nodeid in tests}) == 1, server
        assert [nodeid for nodeid in result["order"] if nodeid in tests] == tests, server
    # The end-to-end tests without a shared server are one unit too.
    rest = [n for n in COLLECTION if n.startswith("tests/e2e/") and n not in SERVERS]
    assert len({result["ran"][nodeid] for nodeid in rest}) == 1


@pytest.mark.parametrize("seed", range(5))
def test_without_the_servers_every_end_to_end_test_is_one_unit_run_beside_unit_tests_only(tmp_path, monkeypatch, seed):
    result = run(tmp_path, monkeypatch, seed, {})
    assert sorted(result["ran"]) == sorted(COLLECTION)
    assert result["heaviest"] <= lanes.BUDGET
    e2e = [nodeid for nodeid in COLLECTION if nodeid.startswith("tests/e2e/")]
    assert len({result["ran"][nodeid] for nodeid in e2e}) == 1
    assert [nodeid for nodeid in result["order"] if nodeid in e2e] == e2e
