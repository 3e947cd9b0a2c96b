"""Per-key limits (spec §2): requests_per_minute, max_concurrent, tokens_per_day.

- requests_per_minute is a sliding window: at most N admitted calls in any 60 seconds.
- max_concurrent counts permits; a permit is taken at admission and given back when the
  response's last byte has been handed to the server. Each permit is a lease with an expiry,
  renewed while its stream flows, so a web process that dies holding one cannot block the key
  for longer than the lease.
- tokens_per_day adds prompt plus completion tokens per UTC day; a call is refused once the
  day's total has reached the limit, with Retry-After until midnight UTC.

Two backends with the same behaviour: `MemoryQuotas` (embedded, one process) and `RedisQuotas`
(distributed): there every decision is one Lua script, so two web processes never both take the
last unit of a limit, and the clock is Redis's own.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import cast

from django.conf import settings

from hypnos_site.errors import RateLimited
from models_registry.authentication import ApiPrincipal
from models_registry.shared_state import LoopRedis, is_distributed, shared_redis, state_key

WINDOW_SECS = 60.0
# A permit's lease until the view answers; then the stream renews it while chunks flow.
ADMISSION_SLACK_SECS = 30.0
STREAM_LEASE_SECS = 60.0
RENEW_EVERY_SECS = 20.0
USAGE_TTL_SECS = 3 * 86400


@dataclass
class Permit:
    """An admitted call of a key. `concurrent`: it holds one of the key's max_concurrent slots."""

    label: str
    permit_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    concurrent: bool = False
    renewed_at: float = field(default_factory=time.monotonic)

    def due_for_renewal(self) -> bool:
        return self.concurrent and time.monotonic() - self.renewed_at >= RENEW_EVERY_SECS


def utc_day(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).date().isoformat()


def secs_to_midnight(now: float) -> int:
    """Whole seconds until the next UTC midnight (at least 1)."""
    moment = datetime.fromtimestamp(now, UTC)
    midnight = datetime.combine(moment.date() + timedelta(days=1), datetime.min.time(), UTC)
    return max(int((midnight - moment).total_seconds() + 0.999), 1)


def refusal(principal: ApiPrincipal, code: str, retry_after: float, used: int = 0) -> RateLimited:
    """The 429 for `code`, with the spec's message and Retry-After."""
    label = principal.label
    if code == "requests_per_minute":
        message = (
            f"The key {label!r} made {principal.requests_per_minute} requests in the last minute "
            f"(requests_per_minute = {principal.requests_per_minute})."
        )
    elif code == "max_concurrent":
        message = (
            f"The key {label!r} already has {principal.max_concurrent} calls in flight "
            f"(max_concurrent = {principal.max_concurrent})."
        )
    else:
        message = (
            f"The key {label!r} used {used} of its {principal.tokens_per_day} tokens today "
            f"(tokens_per_day, UTC day); the quota resets at midnight UTC."
        )
    return RateLimited(message, code=code, retry_after_secs=int(retry_after + 0.999))


def admission_lease_secs() -> float:
    return settings.HYPNOS.limits.request_timeout_secs + ADMISSION_SLACK_SECS


class QuotaBackend(ABC):
    """Counters of the per-key limits, shared by every web process of one server."""

    @abstractmethod
    async def admit(self, principal: ApiPrincipal) -> Permit:
        """Admit a call of `principal` or raise RateLimited (429) naming the limit."""

    @abstractmethod
    async def renew(self, permit: Permit, lease_secs: float) -> None:
        """Push the permit's expiry to `lease_secs` from now."""

    @abstractmethod
    async def release(self, permit: Permit) -> None:
        """Give the permit's concurrency slot back."""

    @abstractmethod
    async def charge(self, label: str, tokens: int) -> None:
        """Add `tokens` to the key's total of the current UTC day."""

    @abstractmethod
    async def tokens_today(self) -> dict[str, int]:
        """Every key's tokens of the current UTC day, by label."""


class MemoryQuotas(QuotaBackend):
    """The embedded deployment's counters: one process, one lock."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self._inflight: dict[str, dict[str, float]] = defaultdict(dict)
        self._usage: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    async def admit(self, principal: ApiPrincipal) -> Permit:
        return self.admit_now(principal, admission_lease_secs())

    def admit_now(self, principal: ApiPrincipal, lease_secs: float) -> Permit:
        label, now = principal.label, self.clock()
        with self._lock:
            if principal.tokens_per_day:
                used = self._usage.get(utc_day(now), {}).get(label, 0)
                if used >= principal.tokens_per_day:
                    raise refusal(principal, "tokens_per_day", secs_to_midnight(now), used)
            recent = self._recent[label]
            while recent and recent[0] <= now - WINDOW_SECS:
                recent.popleft()
            if principal.requests_per_minute and len(recent) >= principal.requests_per_minute:
                raise refusal(principal, "requests_per_minute", recent[0] + WINDOW_SECS - now)
            inflight = self._inflight[label]
            for permit_id in [p for p, expiry in inflight.items() if expiry <= now]:
                del inflight[permit_id]
            if principal.max_concurrent and len(inflight) >= principal.max_concurrent:
                raise refusal(principal, "max_concurrent", 1)
            permit = Permit(label, concurrent=bool(principal.max_concurrent))
            if permit.concurrent:
                inflight[permit.permit_id] = now + lease_secs
            if principal.requests_per_minute:
                recent.append(now)
            return permit

    async def renew(self, permit: Permit, lease_secs: float) -> None:
        with self._lock:
            inflight = self._inflight[permit.label]
            if permit.permit_id in inflight:
                inflight[permit.permit_id] = self.clock() + lease_secs
        permit.renewed_at = time.monotonic()

    async def release(self, permit: Permit) -> None:
        with self._lock:
            self._inflight[permit.label].pop(permit.permit_id, None)

    async def charge(self, label: str, tokens: int) -> None:
        day = utc_day(self.clock())
        with self._lock:
            for past in [d for d in self._usage if d != day]:
                del self._usage[past]
            self._usage[day][label] += tokens

    async def tokens_today(self) -> dict[str, int]:
        with self._lock:
            return dict(self._usage.get(utc_day(self.clock()), {}))


# KEYS: recent calls (zset), permits in flight (zset), today's usage (hash label -> tokens).
# ARGV: label, requests_per_minute, max_concurrent, tokens_per_day (0 = no limit), permit id,
# lease in ms. Returns {refused limit or '', retry-after ms or tokens used}.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, conc, tpd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tpd > 0 then
  local used = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
  if used >= tpd then return {'tokens_per_day', used} end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {'requests_per_minute', tonumber(oldest[2]) + 60000 - now}
  end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= conc then return {'max_concurrent', 1000} end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[5])
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], 61000)
end
return {'', 0}
"""

# KEYS: permits in flight. ARGV: permit id, lease in ms. Only a permit still held is renewed.
RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
"""


class RedisQuotas(QuotaBackend):
    """The distributed deployment's counters, in Redis; each decision is one atomic script."""

    def __init__(self, redis: LoopRedis, prefix_key: Callable[..., str] = state_key):
        self.redis = redis
        self.key = prefix_key

    def _keys(self, label: str) -> list[str]:
        return [
            self.key("quota", label, "recent"),
            self.key("quota", label, "inflight"),
            self.key("usage", utc_day(time.time())),
        ]

    async def admit(self, principal: ApiPrincipal) -> Permit:
        permit = Permit(principal.label, concurrent=bool(principal.max_concurrent))
        args = [
            principal.label,
            principal.requests_per_minute or 0,
            principal.max_concurrent or 0,
            principal.tokens_per_day or 0,
            permit.permit_id,
            int(admission_lease_secs() * 1000),
        ]
        code, value = await self.redis.run_script(ADMIT_LUA, self._keys(principal.label), args)
        if code == "tokens_per_day":
            raise refusal(principal, code, secs_to_midnight(time.time()), int(value))
        if code:
            raise refusal(principal, code, int(value) / 1000)
        return permit

    async def renew(self, permit: Permit, lease_secs: float) -> None:
        permit.renewed_at = time.monotonic()
        await self.redis.run_script(
            RENEW_LUA, [self.key("quota", permit.label, "inflight")], [permit.permit_id, int(lease_secs * 1000)]
        )

    async def release(self, permit: Permit) -> None:
        await self.redis.client().zrem(self.key("quota", permit.label, "inflight"), permit.permit_id)

    async def charge(self, label: str, tokens: int) -> None:
        usage = self.key("usage", utc_day(time.time()))
        async with self.redis.client().pipeline(transaction=False) as pipe:
            pipe.hincrby(usage, label, tokens)
            pipe.expire(usage, USAGE_TTL_SECS)
            await pipe.execute()

    async def tokens_today(self) -> dict[str, int]:
        # redis-py's command stubs type the asyncio client's replies as `Awaitable[T] | T`.
        found = await cast(
            "Awaitable[dict[str, str]]", self.redis.client().hgetall(self.key("usage", utc_day(time.time())))
        )
        return {label: int(tokens) for label, tokens in found.items()}


_memory_quotas = MemoryQuotas()


def get_quotas() -> QuotaBackend:
    """The backend of this deployment."""
    if is_distributed():
        return RedisQuotas(shared_redis())
    return _memory_quotas
