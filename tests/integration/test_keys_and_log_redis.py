"""The distributed deployment's shared state against a real Redis: quota decisions and metric
counters of several web processes (each one its own connections, as separate processes have),
and the views switching to it when `deployment = "distributed"`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hypnos_site.config import KeyConfig
from hypnos_site.errors import RateLimited
from hypnos_site.metrics import RedisCounters, get_counters, observation
from inference.web.common.latency import WORKFLOW_IDLE_SECS, RedisWorkflows, get_workflows
from logs.store import levels
from models_registry.authentication import ApiPrincipal
from models_registry.quotas import Permit, RedisQuotas, get_quotas, secs_to_midnight
from models_registry.shared_state import LoopRedis
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import REDIS_URL, require_service
from tests.integration.conftest import post_json, read_sse, with_server

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2}


@pytest.fixture
def shared(settings: Any, worker: Any, use_worker: Any) -> Iterator[str]:
    """This test's server runs distributed on the real Redis, under a prefix of its own."""
    require_service("Redis", lambda: redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping())
    prefix = "hypnos-test-" + uuid.uuid4().hex[:8]
    use_worker(worker)  # the views keep the in-process worker; only the shared state moves to Redis
    with_server(settings, deployment="distributed", redis_url=REDIS_URL, channel_prefix=prefix)
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def web_processes(n: int) -> list[RedisQuotas]:
    """`n` quota backends with separate connections, as `n` web processes have."""
    return [RedisQuotas(LoopRedis(REDIS_URL)) for _ in range(n)]


async def admit_all(backends: list[RedisQuotas], principal: ApiPrincipal, calls: int) -> list[Permit | RateLimited]:
    async def one(i: int) -> Permit | RateLimited:
        try:
            return await backends[i % len(backends)].admit(principal)
        except RateLimited as exc:
            return exc

    return list(await asyncio.gather(*[one(i) for i in range(calls)]))


async def test_two_processes_admit_exactly_max_concurrent(shared):
    principal = ApiPrincipal(label="pair", admin=False, max_concurrent=3)
    a, b = web_processes(2)
    outcomes = await admit_all([a, b], principal, 20)
    permits = [o for o in outcomes if isinstance(o, Permit)]
    assert len(permits) == 3
    assert {o.code for o in outcomes if isinstance(o, RateLimited)} == {"max_concurrent"}
    await b.release(permits[0])
    assert isinstance(await a.admit(principal), Permit)
    with pytest.raises(RateLimited):
        await b.admit(principal)


async def test_requests_per_minute_is_exact_across_processes(shared):
    principal = ApiPrincipal(label="minute", admin=False, requests_per_minute=5)
    outcomes = await admit_all(web_processes(2), principal, 12)
    refused = [o for o in outcomes if isinstance(o, RateLimited)]
    assert len(refused) == 7
    assert {r.code for r in refused} == {"requests_per_minute"}
    assert all(1 <= r.retry_after_secs <= 60 for r in refused)


async def test_tokens_charged_by_one_process_refuse_the_next_call_in_the_other(shared):
    principal = ApiPrincipal(label="daily", admin=False, tokens_per_day=100)
    a, b = web_processes(2)
    await a.admit(principal)
    await a.charge("daily", 60)
    await b.admit(principal)
    await b.charge("daily", 60)
    with pytest.raises(RateLimited) as refused:
        await a.admit(principal)
    assert refused.value.code == "tokens_per_day"
    assert abs(refused.value.retry_after_secs - secs_to_midnight(time.time())) <= 5
    assert await b.tokens_today() == {"daily": 120}


async def test_a_permit_whose_lease_ran_out_frees_its_slot(shared):
    principal = ApiPrincipal(label="leased", admin=False, max_concurrent=1)
    a, b = web_processes(2)
    permit = await a.admit(principal)
    await a.renew(permit, 0.05)  # as if its process had died right after
    await asyncio.sleep(0.1)
    assert isinstance(await b.admit(principal), Permit)


async def test_the_counters_of_several_processes_add_up(shared):
    a, b = RedisCounters(LoopRedis(REDIS_URL)), RedisCounters(LoopRedis(REDIS_URL))
    await a.record(
        [
            observation("hypnos_api_key_tokens", 40, key="k"),
            observation("hypnos_http_request_latency_ms_max", 12.5, route="/v1/x"),
        ]
    )
    await b.record(
        [
            observation("hypnos_api_key_tokens", 2, key="k"),
            observation("hypnos_http_request_latency_ms_max", 3.0, route="/v1/x"),
            observation("hypnos_chat_ttft_ms", 30, model="m"),
        ]
    )
    snapshot = await a.snapshot()
    assert snapshot == await b.snapshot()
    assert snapshot["hypnos_api_key_tokens"][(("key", "k"),)] == {"value": 42.0}
    assert snapshot["hypnos_http_request_latency_ms_max"][(("route", "/v1/x"),)] == {"value": 12.5}
    ttft = snapshot["hypnos_chat_ttft_ms"][(("model", "m"),)]
    # A histogram: 30 ms falls in every bucket from le 50 up, and in +Inf.
    assert (ttft["count"], ttft["sum"], ttft["le:+Inf"], ttft["le:50"]) == (1.0, 30.0, 1.0, 1.0)
    assert "le:25" not in ttft


async def test_the_views_use_redis_when_distributed(api, settings, shared):
    with_server(settings, api_keys=["sk-admin"], keys=[KeyConfig(key="sk-one", label="one", max_concurrent=1)])
    assert isinstance(get_quotas(), RedisQuotas) and isinstance(get_counters(), RedisCounters)
    stream = await post_json(api, URL, CHAT | {"stream": True}, authorization="Bearer sk-one")
    refused = await post_json(api, URL, CHAT, authorization="Bearer sk-one")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "max_concurrent"
    usage = (await read_sse(stream))[-2]["usage"]
    assert (await post_json(api, URL, CHAT, authorization="Bearer sk-one")).status_code == 200
    assert (await get_quotas().tokens_today())["one"] > usage["total_tokens"]
    counted = redis.Redis.from_url(REDIS_URL, decode_responses=True).hgetall(f"{shared}:metrics:sums")
    assert counted['["hypnos_api_key_rejections","value",[["key","one"]]]'] == "1"
    # The level lives in Redis too: every web process captures at the level set last.
    await post_json(api, "/v1/logs/level", {"level": "debug"}, authorization="Bearer sk-admin")
    assert redis.Redis.from_url(REDIS_URL, decode_responses=True).get(f"{shared}:logs:level") == "debug"
    assert await levels.get() == "debug"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_a_workflow_spread_over_two_processes_closes_once(shared):
    clock = Clock(1000.0)
    a, b = RedisWorkflows(LoopRedis(REDIS_URL), clock), RedisWorkflows(LoopRedis(REDIS_URL), clock)
    assert await a.observe("turn-1", "voice", 1000.0, 1000.4, last=False) == []
    assert await b.observe("turn-1", "voice", 1000.5, 1001.2, last=False) == []
    assert await a.observe("turn-1", "voice", 1001.3, 1002.0, last=True) == [("voice", pytest.approx(2000.0))]
    assert await b.close_idle() == []
    # Many requests of one workflow at once, the last marked: it closes exactly once.
    ends = await asyncio.gather(
        *[(a, b)[i % 2].observe("turn-2", "voice", 1000.0 + i, 1000.5 + i, last=i == 9) for i in range(10)]
    )
    assert [c for closed in ends for c in closed] == [("voice", pytest.approx(9500.0))]


async def test_an_idle_workflow_is_closed_by_whichever_process_looks_first(shared):
    clock = Clock(1000.0)
    a, b = RedisWorkflows(LoopRedis(REDIS_URL), clock), RedisWorkflows(LoopRedis(REDIS_URL), clock)
    await a.observe("chat-1", "agent", 1000.0, 1003.0, last=False)
    clock.now = 1003.0 + WORKFLOW_IDLE_SECS - 1
    assert await b.close_idle() == []
    clock.now = 1003.0 + WORKFLOW_IDLE_SECS + 1
    closed = await asyncio.gather(a.close_idle(), b.close_idle())
    assert sorted(c for found in closed for c in found) == [("agent", pytest.approx(3000.0))]


async def test_route_and_workflow_latency_come_from_the_shared_store(api, settings, shared):
    with_server(settings)
    assert isinstance(get_workflows(), RedisWorkflows)
    turn = {"x-hypnos-workflow": "voice/t-1"}
    assert (await post_json(api, URL, CHAT, **turn)).status_code == 200
    await read_sse(await post_json(api, URL, CHAT | {"stream": True}, **turn, **{"x-hypnos-workflow-end": "true"}))
    # What another web process counted is in this one's figures: one more route sample and
    # one more workflow, written straight to the store.
    other = RedisCounters(LoopRedis(REDIS_URL))
    await other.record(
        [
            observation("hypnos_http_request_latency_ms", 7000, route="/v1/chat/completions"),
            observation("hypnos_workflow_e2e_ms", 40, workflow="voice"),
        ]
    )
    latency = (await api.get("/v1/memory/status")).json()["latency"]
    assert latency["routes"]["/v1/chat/completions"]["count"] == 3
    assert latency["routes"]["/v1/chat/completions"]["p99_ms"] == 10000
    voice = latency["workflows"]["voice"]
    assert voice["count"] == 2 and voice["p50_ms"] == 50 and 50 <= voice["p99_ms"]
