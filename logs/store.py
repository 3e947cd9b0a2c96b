"""The request log's storage: entries in the database (a ring buffer every web process writes),
the current level in the shared state (Redis when distributed, memory when embedded)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Q, QuerySet

from hypnos_site.errors import DATABASE_ERRORS, InvalidRequest, database_reason
from logs.capture import INFERENCE_ROUTES, LEVELS
from logs.models import RequestLogEntry
from models_registry.shared_state import is_distributed, shared_redis, state_key

log = logging.getLogger(__name__)
STATUS_FILTERS = ("ok", "error", "4xx", "5xx")


def capacity() -> int:
    return settings.HYPNOS.server.request_log_capacity


# A surrogate code point in a str is always a lone one (a JSON pair decodes to one code point).
_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(value: Any) -> Any:
    """`value` with every string made encodable as UTF-8: a lone surrogate a client sent
    (JSON's "\\ud800", refused with a 400 but still logged) becomes U+FFFD, which neither SQLite nor
    PostgreSQL refuses."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {k: storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value


# The entries being written after their responses went out (store_later), so that a reader of
# the log in this process (GET /v1/logs, a clear) sees every call answered before it.
_writing: set[asyncio.Future[Any]] = set()


# One writer thread, so the entries land in the order their calls were answered (on a pool of
# threads, five quick calls could be stored out of order, and the ring buffer then kept others).
_writer = ThreadPoolExecutor(1, thread_name_prefix="hypnos-log")


def store_later(fields: dict[str, Any]) -> None:
    """Write the entry in the background: the call's response does not wait for the database.
    Off the request's thread-sensitive executor, which is gone once the response is out."""
    task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(_writer, store_entry, fields))
    _writing.add(task)
    task.add_done_callback(_written)


def _written(task: asyncio.Future[Any]) -> None:
    _writing.discard(task)
    if task.cancelled() or task.exception() is None:
        return
    problem = task.exception()
    if isinstance(problem, DATABASE_ERRORS):
        # An outage, not a bug: one line per lost entry, no traceback.
        log.warning("a request log entry was lost: the database is not answering: %s", database_reason(problem))
    else:
        log.error("writing a request log entry failed", exc_info=problem)


async def settled() -> None:
    """Wait for the entries this process's event loop is still writing."""
    loop = asyncio.get_running_loop()
    pending = [task for task in _writing if task.get_loop() is loop]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def store_entry(fields: dict[str, Any]) -> RequestLogEntry:
    """Add an entry and drop what the ring buffer no longer holds (sync: runs in a thread)."""
    try:
        entry = RequestLogEntry.objects.create(**{name: storable(value) for name, value in fields.items()})
        keep = capacity()
        oldest_kept = list(RequestLogEntry.objects.order_by("-id").values_list("id", flat=True)[keep - 1 : keep])
        if oldest_kept:
            RequestLogEntry.objects.filter(id__lt=oldest_kept[0]).delete()
    except DATABASE_ERRORS:
        # The writer thread sees no request signals, which would close a broken connection:
        # close it here, so that the entries after the database's return go out on a new one.
        connection.close()
        raise
    return entry


@dataclass(frozen=True)
class LogQuery:
    """The filters of GET /v1/logs."""

    model: str | None = None
    route: str | None = None
    status: str | None = None
    key: str | None = None
    limit: int | None = None

    @classmethod
    def from_params(cls, params: Any) -> LogQuery:
        """Read and check the query string; a bad value is a 400 naming it."""
        status = params.get("status") or None
        if status is not None and status not in STATUS_FILTERS and not (status.isdigit() and len(status) == 3):
            raise InvalidRequest(
                f"status must be one of {', '.join(STATUS_FILTERS)} or an HTTP status, not {status!r}.", param="status"
            )
        limit = params.get("limit") or None
        if limit is not None and (not limit.isdigit() or int(limit) < 1):
            raise InvalidRequest(f"limit must be a positive integer, not {limit!r}.", param="limit")
        return cls(
            model=params.get("model") or None,
            route=_route(params.get("route")),
            status=status,
            key=params.get("key") or None,
            limit=int(limit) if limit else None,
        )

    def apply(self, entries: QuerySet[RequestLogEntry]) -> QuerySet[RequestLogEntry]:
        if self.model:
            entries = entries.filter(model=self.model)
        if self.route:
            entries = entries.filter(route=self.route)
        if self.key:
            entries = entries.filter(key_label=self.key)
        if self.status == "ok":
            entries = entries.filter(status__lt=400, error="")
        elif self.status == "error":
            entries = entries.filter(Q(status__gte=400) | ~Q(error=""))
        elif self.status in ("4xx", "5xx"):
            low = int(self.status[0]) * 100
            entries = entries.filter(status__gte=low, status__lt=low + 100)
        elif self.status:
            entries = entries.filter(status=int(self.status))
        entries = entries.order_by("-id")
        return entries[: self.limit] if self.limit else entries


def _route(value: str | None) -> str | None:
    """`/v1/chat/completions`, `/api/v1/chat/completions` and `chat/completions` name one route."""
    if not value:
        return None
    route = value.strip("/").removeprefix("api/").removeprefix("v1/")
    return f"/v1/{route}" if route in INFERENCE_ROUTES else value


class LevelStore:
    """The level the log captures at: `server.request_log_level` until POST /v1/logs/level
    changes it for every web process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._level: str | None = None

    async def get(self) -> str:
        if is_distributed():
            level = await shared_redis().client().get(state_key("logs", "level"))
        else:
            with self._lock:
                level = self._level
        return level if level in LEVELS else settings.HYPNOS.server.request_log_level

    async def set(self, level: str) -> None:
        if level not in LEVELS:
            raise InvalidRequest(f"level must be one of {', '.join(LEVELS)}.", param="level")
        if is_distributed():
            await shared_redis().client().set(state_key("logs", "level"), level)
        else:
            with self._lock:
                self._level = level

    def reset(self) -> None:
        """Back to the configured level (this process's memory only)."""
        with self._lock:
            self._level = None


levels = LevelStore()
