"""The check's JSON report: one entry per step, rewritten whole after every step, so a run killed
at the device's time limit still leaves what it had done."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "failed", "skipped", "not-run")


class StepSkipped(Exception):
    """Raised inside a step that cannot run here (no GPU, nothing cached); `status` is
    "skipped" (not applicable on this machine) or "not-run" (applicable, but not possible:
    too large to carry, no time left)."""

    def __init__(self, reason: str, status: str = "skipped"):
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass
class Step:
    name: str
    status: str = "running"
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


class Report:
    """Steps in the order they ran, written to `path` (atomically) after each one."""

    def __init__(self, path: Path, about: dict[str, Any]):
        self.path = path
        self.about = about
        self.steps: list[Step] = []
        self.started = time.monotonic()

    @contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """Run the block as step `name`: ok when it returns, failed when it raises (the error is
        the reason), skipped / not-run on StepSkipped. The report is written before and after."""
        step = Step(name)
        self.steps.append(step)
        self.write()
        started = time.monotonic()
        try:
            yield step
            step.status = "ok"
        except StepSkipped as exc:
            step.status, step.reason = exc.status, exc.reason
        except Exception as exc:  # a failed step is recorded and the check goes on
            step.status, step.reason = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            step.seconds = round(time.monotonic() - started, 2)
            self.write()

    def record(self, name: str, status: str, reason: str, **figures: Any) -> Step:
        """A step that is decided without running anything (a part that cannot be carried)."""
        assert status in STATUSES, status
        step = Step(name, status, 0.0, figures, reason)
        self.steps.append(step)
        self.write()
        return step

    def get(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        counts = {status: sum(s.status == status for s in self.steps) for status in STATUSES}
        return {
            **self.about,
            "elapsed_seconds": round(time.monotonic() - self.started, 1),
            "counts": counts,
            "steps": [asdict(s) for s in self.steps],
        }

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")
        os.replace(temporary, self.path)
