"""End-to-end latency per route, as p50 / p95 / p99 bucket upper bounds (spec §14 `latency`)."""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any

# Upper bounds in milliseconds; the last bucket is open.
BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_MS) + 1)
        self.total = 0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.total += 1

    def quantile(self, q: float) -> float | None:
        if not self.total:
            return None
        rank, seen = q * self.total, 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return float(BUCKETS_MS[i]) if i < len(BUCKETS_MS) else float("inf")
        return None

    def summary(self) -> dict[str, Any]:
        return {
            "count": self.total,
            "p50_ms": self.quantile(0.5),
            "p95_ms": self.quantile(0.95),
            "p99_ms": self.quantile(0.99),
        }


class RouteLatency:
    """Per-route histograms of this web process."""

    def __init__(self) -> None:
        self._routes: dict[str, Histogram] = {}
        self._lock = threading.Lock()

    def observe(self, route: str, ms: float) -> None:
        with self._lock:
            self._routes.setdefault(route, Histogram()).observe(ms)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {route: h.summary() for route, h in sorted(self._routes.items())}


routes = RouteLatency()


WORKFLOW_IDLE_SECS = 30.0


@dataclass
class _OpenWorkflow:
    name: str
    first_start: float
    last_end: float


class Workflows:
    """End-to-end time of multi-step tasks marked with `x-hypnos-workflow: <name>/<id>`: from the
    first request's start to the last byte of the one marked `x-hypnos-workflow-end: true`, or of
    the last one before 30 s without a request (spec §1)."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._open: dict[str, _OpenWorkflow] = {}
        self._done: dict[str, Histogram] = {}
        self._lock = threading.Lock()

    def observe(self, header: str, started: float, ended: float, last: bool) -> None:
        name, _, ident = header.partition("/")
        with self._lock:
            self._close_idle()
            flow = self._open.setdefault(ident or name, _OpenWorkflow(name, started, ended))
            flow.first_start = min(flow.first_start, started)
            flow.last_end = max(flow.last_end, ended)
            if last:
                self._finish(ident or name)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            self._close_idle()
            return {name: h.summary() for name, h in sorted(self._done.items())}

    def _close_idle(self) -> None:
        now = self.clock()
        for ident in [i for i, f in self._open.items() if now - f.last_end > WORKFLOW_IDLE_SECS]:
            self._finish(ident)

    def _finish(self, ident: str) -> None:
        flow = self._open.pop(ident)
        self._done.setdefault(flow.name, Histogram()).observe((flow.last_end - flow.first_start) * 1000)


workflows = Workflows()
