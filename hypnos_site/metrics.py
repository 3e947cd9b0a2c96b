"""GET /metrics (spec §16): Prometheus text, the same from every web process.

Three sources, one page:
- django-prometheus's `django_http_*` families (requests, latencies, statuses by view). They are
  prometheus_client metrics of the process that serves the request; with PROMETHEUS_MULTIPROC_DIR
  set (the documented multiprocess mode of prometheus_client) every daphne process on the host
  writes them to that directory and this page adds them up.
- the web side's `hypnos_*` counters (HTTP routes, API keys, admissions, evictions, chat speed),
  counted by logs.middleware in the shared store: Redis in the distributed deployment, so every
  process reports the totals of all of them; memory in the embedded one (one process).
- the worker's state (models, tiers, leases, loads, memory), asked at scrape time with the
  `memory_status` control operation, which both deployments answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Awaitable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, cast

import prometheus_client
from django.http import HttpRequest, HttpResponse
from django_prometheus import middleware as django_prometheus
from prometheus_client import multiprocess
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from inference.transport.deadline import within
from models_registry.shared_state import LoopRedis, is_distributed, shared_redis, state_key

log = logging.getLogger(__name__)
PROCESS_STARTED_AT = time.time()
WORKER_STATUS_TIMEOUT_SECS = 5.0

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Family:
    """A hypnos_* family counted by the web side: Prometheus type, help and label names."""

    kind: str  # counter, gauge (a running maximum), summary (a _sum and a _count) or histogram
    help: str
    labels: tuple[str, ...] = ()
    # A histogram's upper bounds (+Inf is implied), so a dashboard computes p95 with
    # histogram_quantile over the cumulative `le` buckets.
    buckets: tuple[float, ...] = ()


MS_BUCKETS = (
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10000.0,
    30000.0,
    60000.0,
    120000.0,
    300000.0,
)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


WEB_FAMILIES: dict[str, Family] = {
    "hypnos_http_requests": Family("counter", "HTTP requests by route and status class.", ("route", "class")),
    "hypnos_http_request_latency_ms": Family(
        "histogram", "End-to-end time of HTTP requests (a stream: to its last byte), ms.", ("route",), MS_BUCKETS
    ),
    "hypnos_http_request_latency_ms_max": Family("gauge", "Longest HTTP request by route, ms.", ("route",)),
    "hypnos_api_key_requests": Family("counter", "Inference calls made with the key, refused ones included.", ("key",)),
    "hypnos_api_key_rejections": Family(
        "counter", "Calls refused by a per-key limit (429 rate_limit_error) or model restriction (403).", ("key",)
    ),
    "hypnos_api_key_tokens": Family("counter", "Prompt plus completion tokens charged to the key.", ("key",)),
    "hypnos_scheduler_admissions_rejected": Family(
        "counter", "Inference calls the scheduler refused (429 model_busy, 503 deadline_unmeetable)."
    ),
    "hypnos_chat_ttft_ms": Family("histogram", "Time to the first token of chat calls, ms.", ("model",), MS_BUCKETS),
    "hypnos_chat_decode_tokens_per_s": Family("summary", "Decode speed of chat calls, tokens/s.", ("model",)),
    "hypnos_chat_prefill_tokens_per_s": Family("summary", "Prefill speed of chat calls, tokens/s.", ("model",)),
    "hypnos_request_e2e_ms": Family(
        "histogram", "Inference calls from arrival to the last byte of the response, ms.", ("route",), MS_BUCKETS
    ),
    "hypnos_pipeline_e2e_ms": Family(
        "histogram",
        "Calls that ran a pipeline (chat input_audio transcribed first), arrival to last byte, ms.",
        ("route",),
        MS_BUCKETS,
    ),
    "hypnos_workflow_e2e_ms": Family(
        "histogram",
        "Declared workflows (x-hypnos-workflow), first request's arrival to the last one's last byte, ms.",
        ("workflow",),
        MS_BUCKETS,
    ),
    "hypnos_prefix_cache_hits": Family("counter", "Text calls that reused cached prompt tokens.", ("model",)),
    "hypnos_prefix_cache_misses": Family("counter", "Text calls that reused no cached prompt tokens.", ("model",)),
    "hypnos_prefix_cache_tokens_reused": Family("counter", "Prompt tokens served from the prefix cache.", ("model",)),
    "hypnos_tts_rtf": Family("histogram", "Speech synthesis time per second of audio.", ("model",), RTF_BUCKETS),
    "hypnos_tts_ttfa_ms": Family("histogram", "Time to the first audio of speech calls, ms.", ("model",), MS_BUCKETS),
    "hypnos_stt_rtf": Family("histogram", "Transcription time per second of audio.", ("model",), RTF_BUCKETS),
    "hypnos_document_ms_per_page": Family(
        "histogram", "Document conversion time per page, ms.", ("model",), MS_BUCKETS
    ),
    "hypnos_document_pages": Family("counter", "Document pages converted.", ("model",)),
    "hypnos_image_jct_s": Family(
        "histogram",
        "Image job completion time (generations, edits, variations, upscales), s.",
        ("model",),
        SECONDS_BUCKETS,
    ),
}


def histogram_fields(family: Family, value: float) -> list[str]:
    """The fields one observation adds 1 to: every bucket its value falls in, and the count."""
    return [_le(bound) for bound in family.buckets if value <= bound] + ["le:+Inf", "count"]


def _le(bound: float) -> str:
    return f"le:{bound:g}"


@dataclass
class Observation:
    """One update of a web family: add `value` (counter), add to _sum and _count (summary), or
    raise the maximum (gauge)."""

    name: str
    labels: Labels
    value: float


def observation(name: str, value: float, **labels: str) -> Observation:
    family = WEB_FAMILIES[name]
    assert set(labels) == set(family.labels), f"{name} takes labels {family.labels}"
    return Observation(name, tuple((k, labels[k]) for k in family.labels), float(value))


class CounterStore(ABC):
    """Where the web families are counted; `snapshot` gives name -> labels -> {field: value}
    with fields `value` (counter, gauge) or `sum` and `count` (summary)."""

    @abstractmethod
    async def record(self, observations: Iterable[Observation]) -> None: ...

    @abstractmethod
    async def snapshot(self) -> dict[str, dict[Labels, dict[str, float]]]: ...


class MemoryCounters(CounterStore):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))

    async def record(self, observations: Iterable[Observation]) -> None:
        with self._lock:
            for obs in observations:
                fields = self._values[obs.name][obs.labels]
                kind = WEB_FAMILIES[obs.name].kind
                if kind == "gauge":
                    fields["value"] = max(fields.get("value", obs.value), obs.value)
                elif kind == "histogram":
                    for name in histogram_fields(WEB_FAMILIES[obs.name], obs.value):
                        fields[name] = fields.get(name, 0.0) + 1
                    fields["sum"] = fields.get("sum", 0.0) + obs.value
                elif kind == "summary":
                    fields["sum"] = fields.get("sum", 0.0) + obs.value
                    fields["count"] = fields.get("count", 0.0) + 1
                else:
                    fields["value"] = fields.get("value", 0.0) + obs.value

    async def snapshot(self) -> dict[str, dict[Labels, dict[str, float]]]:
        with self._lock:
            return {
                name: {labels: dict(fields) for labels, fields in rows.items()} for name, rows in self._values.items()
            }


# KEYS: the sums hash, the maxima hash. ARGV: triples of op ('add' or 'max'), field, value.
# One script, so a request's updates cost one round trip and land together.
RECORD_LUA = """
for i = 1, #ARGV, 3 do
  local op, field, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if op == 'add' then
    redis.call('HINCRBYFLOAT', KEYS[1], field, value)
  else
    local current = tonumber(redis.call('HGET', KEYS[2], field) or '-inf')
    if tonumber(value) > current then redis.call('HSET', KEYS[2], field, value) end
  end
end
return 1
"""


class RedisCounters(CounterStore):
    """One Redis hash of sums (HINCRBYFLOAT) and one of maxima, updated by one Lua script per
    request; a field is `[name, field, labels]` in JSON."""

    def __init__(self, redis: LoopRedis):
        self.redis = redis

    async def record(self, observations: Iterable[Observation]) -> None:
        args: list[Any] = []
        for obs in observations:
            kind = WEB_FAMILIES[obs.name].kind
            if kind == "gauge":
                args += ["max", _field(obs.name, "value", obs.labels), obs.value]
            elif kind == "histogram":
                for name in histogram_fields(WEB_FAMILIES[obs.name], obs.value):
                    args += ["add", _field(obs.name, name, obs.labels), 1]
                args += ["add", _field(obs.name, "sum", obs.labels), obs.value]
            elif kind == "summary":
                args += ["add", _field(obs.name, "count", obs.labels), 1]
                args += ["add", _field(obs.name, "sum", obs.labels), obs.value]
            else:
                args += ["add", _field(obs.name, "value", obs.labels), obs.value]
        if args:
            keys = [state_key("metrics", "sums"), state_key("metrics", "maxima")]
            await self.redis.run_script(RECORD_LUA, keys, args)

    async def snapshot(self) -> dict[str, dict[Labels, dict[str, float]]]:
        client = self.redis.client()
        found: dict[str, dict[Labels, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for key in (state_key("metrics", "sums"), state_key("metrics", "maxima")):
            values = await cast("Awaitable[dict[str, str]]", client.hgetall(key))
            for raw, value in values.items():
                name, field, labels = json.loads(raw)
                if name in WEB_FAMILIES:
                    found[name][tuple((k, v) for k, v in labels)][field] = float(value)
        return found


def _field(name: str, field: str, labels: Labels) -> str:
    return json.dumps([name, field, [list(pair) for pair in labels]], separators=(",", ":"))


_memory_counters = MemoryCounters()


def get_counters() -> CounterStore:
    """The store of this deployment."""
    if is_distributed():
        return RedisCounters(shared_redis())
    return _memory_counters


# The counts this process is still writing (count_later), per event loop.
_counting: set[asyncio.Task[None]] = set()


def count_later(observations: list[Observation], what: str) -> None:
    """Count in the background: a response does not wait for the shared store's round trip.
    A snapshot taken in this process waits for them first (counted)."""
    in_background(get_counters().record(observations), what)


def in_background(work: Coroutine[Any, Any, None], what: str) -> None:
    """Run a store update off the response path (counted() waits for it); a failure is logged."""
    task = asyncio.ensure_future(_logged(work, what))
    _counting.add(task)
    task.add_done_callback(_counting.discard)


async def _logged(work: Coroutine[Any, Any, None], what: str) -> None:
    try:
        await work
    except Exception:
        log.warning("counting %s failed", what, exc_info=True)


async def counted() -> None:
    """Wait for the counts this process's event loop is still writing."""
    loop = asyncio.get_running_loop()
    pending = [task for task in _counting if task.get_loop() is loop]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


# -- the page ---------------------------------------------------------------------------------


def web_families(snapshot: dict[str, dict[Labels, dict[str, float]]], tokens_today: dict[str, int]) -> list[Metric]:
    """The web side's hypnos_* families from a store snapshot and the keys' usage of today."""
    families: list[Metric] = []
    for name, family in WEB_FAMILIES.items():
        labels = list(family.labels)
        metric: Any
        if family.kind == "counter":
            metric = CounterMetricFamily(name, family.help, labels=labels)
        elif family.kind == "summary":
            metric = SummaryMetricFamily(name, family.help, labels=labels)
        elif family.kind == "histogram":
            metric = HistogramMetricFamily(name, family.help, labels=labels)
        else:
            metric = GaugeMetricFamily(name, family.help, labels=labels)
        for key, fields in sorted(snapshot.get(name, {}).items()):
            values = [v for _, v in key]
            if family.kind == "summary":
                metric.add_metric(values, count_value=fields.get("count", 0), sum_value=fields.get("sum", 0.0))
            elif family.kind == "histogram":
                buckets = [(f"{bound:g}", fields.get(_le(bound), 0.0)) for bound in family.buckets]
                metric.add_metric(
                    values, buckets=[*buckets, ("+Inf", fields.get("le:+Inf", 0.0))], sum_value=fields.get("sum", 0.0)
                )
            else:
                metric.add_metric(values, fields.get("value", 0.0))
        families.append(metric)
    today = GaugeMetricFamily(
        "hypnos_api_key_tokens_today", "Tokens charged to the key in the current UTC day.", labels=["key"]
    )
    for label, tokens in sorted(tokens_today.items()):
        today.add_metric([label], tokens)
    families.append(today)
    return families


TIER_NUMBER = {"tier1_gpu_vram": 1, "tier2_pinned_ram": 2, "tier3_nvme_ssd": 3}


def worker_families(status: dict[str, Any] | None) -> list[Metric]:
    """Models, tiers, leases, loads and memory from the worker's `memory_status` (None: no
    worker answered)."""
    up = GaugeMetricFamily("hypnos_worker_up", "Whether an inference worker answered this scrape.")
    up.add_metric([], 0 if status is None else 1)
    if status is None:
        return [up]
    per_model = {
        "hypnos_model_tier": ("gauge", "Tier the model is in: 1 GPU VRAM, 2 pinned RAM, 3 disk."),
        "hypnos_model_gpu_layers": ("gauge", "Layers of the model placed in tier 1."),
        "hypnos_model_active_leases": ("gauge", "Requests holding the model where it is."),
        "hypnos_model_requests": ("counter", "Requests the model has served."),
        "hypnos_model_loads": ("counter", "Loads of the model into tier 1."),
        "hypnos_model_load_failures": ("counter", "Loads of the model that failed."),
        "hypnos_model_requests_per_minute": ("gauge", "The model's decayed request rate (eviction weighs it)."),
    }
    made = {
        name: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=["model"])
        for name, (kind, text) in per_model.items()
    }
    for model in status.get("models", []):
        row = [model["id"]]
        made["hypnos_model_tier"].add_metric(row, TIER_NUMBER.get(model.get("current_tier", ""), 3))
        made["hypnos_model_gpu_layers"].add_metric(row, (model.get("placement") or {}).get("gpu_layers", 0))
        made["hypnos_model_active_leases"].add_metric(row, model.get("active_leases", 0))
        made["hypnos_model_requests"].add_metric(row, model.get("total_requests_served", 0))
        made["hypnos_model_loads"].add_metric(row, model.get("loads", 0))
        made["hypnos_model_load_failures"].add_metric(row, model.get("load_failures", 0))
        made["hypnos_model_requests_per_minute"].add_metric(row, model.get("requests_per_minute", 0.0))
    promotions = CounterMetricFamily("hypnos_scheduler_promotions", "Loads of any model into tier 1.")
    promotions.add_metric([], sum(m.get("loads", 0) for m in status.get("models", [])))
    failures = CounterMetricFamily("hypnos_scheduler_load_failures", "Failed loads of any model.")
    failures.add_metric([], sum(m.get("load_failures", 0) for m in status.get("models", [])))
    evictions = CounterMetricFamily("hypnos_scheduler_evictions", "Models the worker evicted, for any reason.")
    evictions.add_metric([], status.get("evictions_total", 0))
    capabilities = status.get("capabilities", {})
    vram = GaugeMetricFamily(
        "hypnos_vram_bytes",
        "Tier 1 bytes: budget, booked (used), free, and what the device "
        "reports (real_free, real_total, unaccounted, effective_free).",
        labels=["kind"],
    )
    for kind, value in [
        ("budget", capabilities.get("usable_vram_budget_bytes")),
        ("used", status.get("tier1_vram_used_bytes")),
        ("free", status.get("tier1_vram_free_bytes")),
        ("real_free", status.get("tier1_vram_real_free_bytes")),
        ("real_total", status.get("tier1_vram_real_total_bytes")),
        ("unaccounted", status.get("tier1_vram_unaccounted_bytes")),
        ("effective_free", status.get("tier1_vram_effective_free_bytes")),
    ]:
        if value is not None:
            vram.add_metric([kind], value)
    ram = GaugeMetricFamily("hypnos_pinned_ram_bytes", "Tier 2 bytes: budget, used, free.", labels=["kind"])
    for kind, value in [
        ("budget", capabilities.get("pinned_ram_budget_bytes")),
        ("used", status.get("tier2_pinned_ram_used_bytes")),
        ("free", status.get("tier2_pinned_ram_free_bytes")),
    ]:
        if value is not None:
            ram.add_metric([kind], value)
    process = GaugeMetricFamily("hypnos_worker_process_memory_bytes", "Resident memory of the inference worker.")
    process.add_metric([], status.get("process_memory_bytes") or 0)
    families: list[Metric] = [up, *made.values(), promotions, failures, evictions, vram, ram, process]
    families += _per_worker(status)
    for name, value in sorted((status.get("gpu") or {}).items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge = GaugeMetricFamily(f"hypnos_gpu_{name}", f"GPU {name.replace('_', ' ')} (NVML).")
            gauge.add_metric([], value)
            families.append(gauge)
    return families


def _per_worker(status: dict[str, Any]) -> list[Metric]:
    """The same figures by inference worker (several workers: the status is their merge)."""
    info = GaugeMetricFamily(
        "hypnos_worker_info", "An inference worker that answered, by its device.", labels=["worker", "device"]
    )
    vram = GaugeMetricFamily(
        "hypnos_worker_vram_bytes", "Tier 1 bytes of each worker: budget, used, free.", labels=["worker", "kind"]
    )
    ram = GaugeMetricFamily(
        "hypnos_worker_pinned_ram_bytes", "Tier 2 bytes of each worker: budget, used, free.", labels=["worker", "kind"]
    )
    for worker in status.get("workers", []):
        name = str(worker.get("worker_id", ""))
        info.add_metric([name, str(worker.get("device", ""))], 1)
        for family, prefix in ((vram, "tier1_vram"), (ram, "tier2_pinned_ram")):
            for kind in ("budget", "used", "free"):
                if worker.get(f"{prefix}_{kind}_bytes") is not None:
                    family.add_metric([name, kind], worker[f"{prefix}_{kind}_bytes"])
    tier = GaugeMetricFamily(
        "hypnos_model_worker_tier", "Tier of the model on each worker that has it.", labels=["model", "worker"]
    )
    for model in status.get("models", []):
        for place in model.get("placements") or [
            {"worker": model.get("worker", ""), "current_tier": model.get("current_tier")}
        ]:
            tier.add_metric(
                [model["id"], str(place.get("worker") or "")], TIER_NUMBER.get(place.get("current_tier") or "", 3)
            )
    return [info, vram, ram, tier]


def batch_families() -> list[Metric]:
    """The Batch API's lines and batches, from the batches' rows (every process's jobs write
    them): lines ended by outcome, lines still to run, batches by status. Reads the database:
    call it from a sync context."""
    from django.db.models import Count, F, Sum

    from logs.models import Batch

    ended = Batch.objects.aggregate(completed=Sum("completed"), failed=Sum("failed"))
    pending = Batch.objects.filter(status__in=("in_progress", "cancelling")).aggregate(
        lines=Sum(F("total") - F("completed") - F("failed"))
    )
    lines = CounterMetricFamily(
        "hypnos_batch_lines", "Batch lines ended, by outcome (2xx: completed).", labels=["status"]
    )
    for status in ("completed", "failed"):
        lines.add_metric([status], float(ended[status] or 0))
    queue = GaugeMetricFamily("hypnos_batch_queue_lines", "Lines of running batches not yet run.")
    queue.add_metric([], float(pending["lines"] or 0))
    batches = GaugeMetricFamily("hypnos_batches", "Batches by status.", labels=["status"])
    for row in Batch.objects.values("status").annotate(n=Count("id")).order_by("status"):
        batches.add_metric([row["status"]], float(row["n"]))
    return [lines, queue, batches]


async def batch_status() -> list[Metric]:
    from asgiref.sync import sync_to_async
    from django.db import DatabaseError

    try:
        return await sync_to_async(batch_families)()
    except DatabaseError as exc:
        log.warning("metrics: the batches are unavailable: %s", exc)
        return []


def process_families() -> list[Metric]:
    uptime = GaugeMetricFamily("hypnos_uptime_seconds", "Seconds since this web process started.")
    uptime.add_metric([], time.time() - PROCESS_STARTED_AT)
    started = GaugeMetricFamily("hypnos_process_start_time_seconds", "Unix time this web process started.")
    started.add_metric([], PROCESS_STARTED_AT)
    return [uptime, started]


class _Families:
    """A collector that hands out families computed beforehand (the worker's status is awaited
    by the view, and prometheus_client collectors are synchronous)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def django_registry() -> prometheus_client.CollectorRegistry:
    """django-prometheus's registry: this process's, or every process's in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return prometheus_client.REGISTRY


async def worker_status() -> dict[str, Any] | None:
    from inference.transport.runtime import get_client

    try:
        return await within(get_client().control("memory_status"), WORKER_STATUS_TIMEOUT_SECS)
    except Exception as exc:  # noqa: BLE001 - a scrape must answer whatever the worker does
        log.warning("metrics: the worker's memory status is unavailable: %s", exc)
        return None


KEY_FAMILIES = (
    "hypnos_api_key_requests",
    "hypnos_api_key_rejections",
    "hypnos_api_key_tokens",
    "hypnos_api_key_tokens_today",
)


async def hypnos_families(with_keys: bool = True) -> list[Metric]:
    """Every hypnos_* family; without `with_keys`, none of the hypnos_api_key_* ones (their
    labels name every key of the server)."""
    from models_registry.quotas import get_quotas

    await counted()
    try:
        snapshot, today = await get_counters().snapshot(), await get_quotas().tokens_today()
    except Exception as exc:  # noqa: BLE001
        log.warning("metrics: the shared counters are unavailable: %s", exc)
        snapshot, today = {}, {}
    families = [
        *web_families(snapshot, today),
        *worker_families(await worker_status()),
        *await batch_status(),
        *process_families(),
    ]
    return families if with_keys else [f for f in families if f.name not in KEY_FAMILIES]


def render(families: list[Metric]) -> bytes:
    own = prometheus_client.CollectorRegistry(auto_describe=False)
    own.register(_Families(families))  # type: ignore[arg-type]
    return prometheus_client.generate_latest(django_registry()) + prometheus_client.generate_latest(own)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics; open unless `server.metrics_require_auth` (then any valid key). The
    hypnos_api_key_* families name every key's label, so when keys are configured they are on
    the page only for an admin key: a scraper that wants them sends one (`authorization`)."""
    from django.conf import settings

    from hypnos_site.errors import AuthenticationError, MethodNotAllowed
    from models_registry.authentication import arequest_key_check

    if request.method not in ("GET", "HEAD"):
        return MethodNotAllowed(f'Method "{request.method}" not allowed.').response()
    check = await arequest_key_check(request)
    if settings.HYPNOS.server.metrics_require_auth and check.refused:
        return AuthenticationError(check.problem or "").response()
    with_keys = not check.required or (check.principal is not None and check.principal.admin)
    page = render(await hypnos_families(with_keys))
    return HttpResponse(page, content_type=CONTENT_TYPE_PLAIN_0_0_4)


# -- django-prometheus, without a thread hop per request -----------------------------------------


class PrometheusBeforeMiddleware(django_prometheus.PrometheusBeforeMiddleware):
    """django-prometheus's first middleware. Its hooks only touch in-memory (or mmap) counters,
    so on the async path they run inline instead of through sync_to_async."""

    async def __acall__(self, request: HttpRequest) -> HttpResponse:  # type: ignore[override]
        self.process_request(request)
        return self.process_response(request, await self.get_response(request))


class PrometheusAfterMiddleware(django_prometheus.PrometheusAfterMiddleware):
    """django-prometheus's last middleware, inline on the async path like the first one."""

    async def __acall__(self, request: HttpRequest) -> HttpResponse:  # type: ignore[override]
        self.process_request(request)
        return self.process_response(request, await self.get_response(request))

    async def process_view(self, request, view_func, *view_args, **view_kwargs):  # type: ignore[no-untyped-def]
        super().process_view(request, view_func, *view_args, **view_kwargs)
