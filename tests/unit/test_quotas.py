"""Per-key limits of the embedded deployment (MemoryQuotas) with a clock the tests move; the Redis
backend passes the same decisions in tests/integration/test_keys_and_log_redis.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from hypnos_site.errors import RateLimited
from models_registry.authentication import ApiPrincipal
from models_registry.quotas import MemoryQuotas, Permit, secs_to_midnight, utc_day

NOON = datetime(2026, 3, 14, 12, 0, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, now: float = NOON):
        self.now = now

    def __call__(self) -> float:
        return self.now


def admit(quotas: MemoryQuotas, principal: ApiPrincipal, lease_secs: float = 60) -> Permit | RateLimited:
    try:
        return quotas.admit_now(principal, lease_secs)
    except RateLimited as exc:
        return exc


def test_it_admits_requests_per_minute_in_any_sixty_seconds():
    clock = Clock()
    quotas = MemoryQuotas(clock)
    key = ApiPrincipal(label="a", admin=False, requests_per_minute=3)
    for offset in (0, 10, 20):
        clock.now = NOON + offset
        assert isinstance(admit(quotas, key), Permit)
    clock.now = NOON + 59
    refused = admit(quotas, key)
    assert isinstance(refused, RateLimited) and refused.code == "requests_per_minute"
    assert refused.retry_after_secs == 1  # the call of NOON leaves the window at NOON + 60
    clock.now = NOON + 60
    assert isinstance(admit(quotas, key), Permit)
    assert isinstance(admit(quotas, key), RateLimited)


async def test_a_refused_call_does_not_use_up_the_minute():
    quotas = MemoryQuotas(Clock())
    key = ApiPrincipal(label="a", admin=False, requests_per_minute=2, max_concurrent=1)
    first = admit(quotas, key)
    assert isinstance(first, Permit)
    refused = admit(quotas, key)
    assert isinstance(refused, RateLimited) and refused.code == "max_concurrent"
    await quotas.release(first)
    assert isinstance(admit(quotas, key), Permit)


async def test_max_concurrent_counts_permits_until_they_are_released():
    quotas = MemoryQuotas(Clock())
    key = ApiPrincipal(label="c", admin=False, max_concurrent=2)
    first, second = admit(quotas, key), admit(quotas, key)
    assert isinstance(first, Permit) and isinstance(second, Permit)
    refused = admit(quotas, key)
    assert isinstance(refused, RateLimited) and refused.code == "max_concurrent" and refused.retry_after_secs == 1
    await quotas.release(first)
    assert isinstance(admit(quotas, key), Permit)


async def test_a_permit_past_its_lease_no_longer_counts():
    clock = Clock()
    quotas = MemoryQuotas(clock)
    key = ApiPrincipal(label="c", admin=False, max_concurrent=1)
    permit = admit(quotas, key, lease_secs=60)
    assert isinstance(permit, Permit)
    clock.now += 50
    await quotas.renew(permit, 60)
    clock.now += 50
    assert isinstance(admit(quotas, key), RateLimited)
    clock.now += 11
    assert isinstance(admit(quotas, key), Permit)


async def test_tokens_per_day_refuses_until_midnight_utc_and_resets_then():
    clock = Clock()
    quotas = MemoryQuotas(clock)
    key = ApiPrincipal(label="t", admin=False, tokens_per_day=100)
    await quotas.charge("t", 99)
    assert isinstance(admit(quotas, key), Permit)
    await quotas.charge("t", 30)  # the call that crosses the limit is served; the next is not
    refused = admit(quotas, key)
    assert isinstance(refused, RateLimited) and refused.code == "tokens_per_day"
    assert refused.retry_after_secs == 12 * 3600
    assert "used 129 of its 100 tokens" in refused.message
    assert await quotas.tokens_today() == {"t": 129}
    clock.now = NOON + 12 * 3600
    assert isinstance(admit(quotas, key), Permit)
    assert await quotas.tokens_today() == {}


def test_a_key_without_limits_is_always_admitted():
    quotas = MemoryQuotas(Clock())
    key = ApiPrincipal(label="free", admin=True)
    assert all(isinstance(admit(quotas, key), Permit) for _ in range(100))


@pytest.mark.parametrize(
    ("moment", "secs"),
    [((23, 59, 59), 1), ((0, 0, 0), 86400), ((12, 0, 0), 43200)],
)
def test_the_seconds_to_midnight_are_counted_in_utc(moment, secs):
    now = datetime(2026, 3, 14, *moment, tzinfo=UTC).timestamp()
    assert secs_to_midnight(now) == secs
    assert utc_day(now) == "2026-03-14"


def test_a_refusal_is_the_spec_429_with_retry_after():
    key = ApiPrincipal(label="team", admin=False, requests_per_minute=2)
    response = RateLimited("slow down", code="requests_per_minute", retry_after_secs=17).response()
    assert response.status_code == 429 and response["Retry-After"] == "17"
    assert json.loads(response.content) == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "requests_per_minute"}
    }
    assert key.limited and not ApiPrincipal(label="x", admin=False).limited


def test_a_model_list_matches_ids_and_aliases():
    key = ApiPrincipal(label="m", admin=False, models=("gpt-4o-mini",))
    assert key.may_use("smollm2-135m") and key.may_use("gpt-4o-mini")
    assert not key.may_use("qwen2.5-coder-0.5b") and not key.may_use("nope")
    assert ApiPrincipal(label="any", admin=False).may_use("nope")
