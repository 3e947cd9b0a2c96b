"""End-to-end latency per route and per declared workflow, as p50 / p95 / p99 bucket upper
bounds (spec §1 workflows, §14 `latency`), the same from every web process.

Both are histograms of the web families' store (hypnos_site.metrics): Redis in the distributed
deployment, so every daphne process reports what all of them served; memory in the embedded
one. A route's figures are `hypnos_http_request_latency_ms`; a workflow's are
`hypnos_workflow_e2e_ms`, observed when the workflow closes. Which workflows are still open
(first start, last end) is shared the same way: a workflow's requests may reach different web
processes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync

from hypnos_site.metrics import (
    MS_BUCKETS,
    counted,
    get_counters,
    in_background,
    observation,
)
from models_registry.shared_state import LoopRedis, is_distributed, shared_redis, state_key

WORKFLOW_IDLE_SECS = 30.0
ROUTE_FAMILY = "hypnos_http_request_latency_ms"
WORKFLOW_FAMILY = "hypnos_workflow_e2e_ms"


def quantiles(fields: dict[str, float]) -> dict[str, Any]:
    """count and p50 / p95 / p99 (the upper bound of the bucket the rank falls in; inf past
    the last) of one histogram's cumulative `le:` fields."""
    total = int(fields.get("le:+Inf", 0))

    def quantile(q: float) -> float | None:
        if not total:
            return None
        for bound in MS_BUCKETS:
            if fields.get(f"le:{bound:g}", 0) >= q * total:
                return bound
        return float("inf")

    return {"count": total, "p50_ms": quantile(0.5), "p95_ms": quantile(0.95), "p99_ms": quantile(0.99)}


async def summary() -> dict[str, Any]:
    """The memory status's `latency`: routes and closed workflows, of every web process."""
    await counted()
    await close_idle_workflows()
    snapshot = await get_counters().snapshot()

    def rows(family: str, label: str) -> dict[str, Any]:
        found = {dict(labels)[label]: quantiles(fields) for labels, fields in snapshot.get(family, {}).items()}
        return {name: found[name] for name in sorted(found) if name != "unmatched"}

    return {"routes": rows(ROUTE_FAMILY, "route"), "workflows": rows(WORKFLOW_FAMILY, "workflow")}


# -- workflows still open --------------------------------------------------------------------


@dataclass
class _OpenWorkflow:
    name: str
    first_start: float
    last_end: float


class WorkflowStore(ABC):
    """Which workflows are open: `observe` adds a request (wall-clock seconds) and returns the
    workflows it closed, with the idle ones, as (name, ms) pairs; `close_idle` only those."""

    @abstractmethod
    async def observe(
        self, ident: str, name: str, started: float, ended: float, last: bool
    ) -> list[tuple[str, float]]: ...

    @abstractmethod
    async def close_idle(self) -> list[tuple[str, float]]: ...


class MemoryWorkflows(WorkflowStore):
    def __init__(self, clock: Any = time.time) -> None:
        self.clock = clock
        self._open: dict[str, _OpenWorkflow] = {}
        self._lock = threading.Lock()

    async def observe(self, ident: str, name: str, started: float, ended: float, last: bool) -> list[tuple[str, float]]:
        with self._lock:
            closed = self._close_idle()
            flow = self._open.setdefault(ident, _OpenWorkflow(name, started, ended))
            flow.first_start = min(flow.first_start, started)
            flow.last_end = max(flow.last_end, ended)
            if last:
                closed.append(self._finish(ident))
            return closed

    async def close_idle(self) -> list[tuple[str, float]]:
        with self._lock:
            return self._close_idle()

    def _close_idle(self) -> list[tuple[str, float]]:
        now = self.clock()
        idle = [i for i, f in self._open.items() if now - f.last_end > WORKFLOW_IDLE_SECS]
        return [self._finish(ident) for ident in idle]

    def _finish(self, ident: str) -> tuple[str, float]:
        flow = self._open.pop(ident)
        return flow.name, (flow.last_end - flow.first_start) * 1000


# KEYS: the open workflows (hash ident -> [name, first start, last end]), their last ends (zset).
# ARGV: now, idle secs, then ident, name, started, ended, last ('1' or '0') or nothing (only
# close the idle ones). Returns name, ms, name, ms ... of the workflows it closed: one script, so
# two web processes never close the same workflow twice.
WORKFLOW_LUA = """
local closed = {}
local function finish(id)
  local raw = redis.call('HGET', KEYS[1], id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  if raw then
    local flow = cjson.decode(raw)
    table.insert(closed, flow[1])
    table.insert(closed, tostring((flow[3] - flow[2]) * 1000))
  end
end
local now, idle = tonumber(ARGV[1]), tonumber(ARGV[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. tostring(now - idle))) do
  finish(id)
end
if #ARGV > 2 then
  local id, name, started, ended = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  local raw = redis.call('HGET', KEYS[1], id)
  if raw then
    local flow = cjson.decode(raw)
    started, ended = math.min(flow[2], started), math.max(flow[3], ended)
  end
  redis.call('HSET', KEYS[1], id, cjson.encode({name, started, ended}))
  redis.call('ZADD', KEYS[2], ended, id)
  if ARGV[7] == '1' then finish(id) end
end
return closed
"""


class RedisWorkflows(WorkflowStore):
    def __init__(self, redis: LoopRedis, clock: Any = time.time) -> None:
        self.redis = redis
        self.clock = clock

    async def observe(self, ident: str, name: str, started: float, ended: float, last: bool) -> list[tuple[str, float]]:
        return await self._run([ident, name, repr(started), repr(ended), "1" if last else "0"])

    async def close_idle(self) -> list[tuple[str, float]]:
        return await self._run([])

    async def _run(self, request: list[str]) -> list[tuple[str, float]]:
        keys = [state_key("workflows", "open"), state_key("workflows", "ends")]
        found = await self.redis.run_script(WORKFLOW_LUA, keys, [repr(self.clock()), WORKFLOW_IDLE_SECS, *request])
        return [(found[i], float(found[i + 1])) for i in range(0, len(found), 2)]


_memory_workflows = MemoryWorkflows()


def get_workflows() -> WorkflowStore:
    return RedisWorkflows(shared_redis()) if is_distributed() else _memory_workflows


async def _count_closed(closed: list[tuple[str, float]]) -> None:
    if closed:
        await get_counters().record([observation(WORKFLOW_FAMILY, ms, workflow=name) for name, ms in closed])


async def _observe_workflow(header: str, started: float, ended: float, last: bool) -> None:
    name, _, ident = header.partition("/")
    await _count_closed(await get_workflows().observe(ident or name, name, started, ended, last))


async def close_idle_workflows() -> None:
    await _count_closed(await get_workflows().close_idle())


def observe_workflow(header: str, started: float, ended: float, last: bool) -> None:
    """A request of the workflow `header` (`<name>/<id>`) ran from `started` to `ended` (wall
    clock); `last`: the client marked it the workflow's end. Off the response path."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        async_to_sync(_observe_workflow)(header, started, ended, last)
        return
    in_background(_observe_workflow(header, started, ended, last), f"workflow {json.dumps(header)}")
