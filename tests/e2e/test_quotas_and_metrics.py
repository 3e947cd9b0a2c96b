"""Per-key limits, the request log and /metrics across two web processes: two daphne processes
sharing one `runinference`, one Redis and one PostgreSQL database, driven over real sockets.

Every call the module makes goes into a ledger; the last tests check the log and the metrics of
both processes against it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from models_registry.quotas import secs_to_midnight
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import (
    POSTGRES_ADMIN_URL,
    Proc,
    base_env,
    free_port,
    run_manage,
    start,
    stop_all,
    wait_ready,
    write_config,
)

pytestmark = pytest.mark.e2e
URL = "/v1/chat/completions"
ADMIN = "sk-e2e-admin"
KEYS = {"conc": "sk-e2e-conc", "rpm": "sk-e2e-rpm", "tpd": "sk-e2e-tpd", "plain": "sk-e2e-plain"}
KEYS_TOML = f"""
[[server.keys]]
key = "{KEYS["conc"]}"
label = "conc"
max_concurrent = 2

[[server.keys]]
key = "{KEYS["rpm"]}"
label = "rpm"
requests_per_minute = 5

[[server.keys]]
key = "{KEYS["tpd"]}"
label = "tpd"
tokens_per_day = 1

[[server.keys]]
key = "{KEYS["plain"]}"
label = "plain"
"""
SHORT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2, "temperature": 0}
# A long answer (2000 tokens, half a minute here): the admitted streams are still running, however
# loaded the machine, until the test closes them.
LONG = {
    "model": "smollm2-135m",
    "max_tokens": 2000,
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
}


@dataclass
class Call:
    key: str
    request_id: str
    status: int
    usage: dict[str, int] | None
    stream: bool
    code: str | None = None
    # The client closed the stream before its end: charged its delivered deltas, usage unknown.
    dropped: bool = False


@dataclass
class Pair:
    """Two web processes of one distributed server, and every call made to them."""

    urls: list[str]
    procs: list[Proc]
    ledger: list[Call] = field(default_factory=list)

    def url(self, i: int) -> str:
        return self.urls[i % 2]


def _create_database() -> str:
    name = "hypnos_e2e_quotas_" + uuid.uuid4().hex[:8]
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def _drop_database(name: str) -> None:
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def pair(tmp_path_factory, redis_url: str, postgres_url: str) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("quotas")
    config = write_config(directory)
    config.write_text(config.read_text() + KEYS_TOML)
    database = _create_database()
    prefix = "hypnos-quotas-" + uuid.uuid4().hex[:8]
    env = base_env(
        config,
        directory,
        HYPNOS_DEPLOYMENT="distributed",
        HYPNOS_REDIS_URL=redis_url,
        HYPNOS_CHANNEL_PREFIX=prefix,
        HYPNOS_DATABASE_URL=postgres_url.rpartition("/")[0] + "/" + database,
        HYPNOS_API_KEYS=ADMIN,
    )
    multiproc = directory / "prometheus"
    multiproc.mkdir()
    procs: list[Proc] = []
    try:
        run_manage(["migrate", "--no-input", "-v0"], env)
        procs.append(start("runinference-quotas", ["manage.py", "runinference"], env, directory))
        ports = [free_port()]
        while len(ports) < 2:
            ports += [p for p in [free_port()] if p not in ports]
        for i, port in enumerate(ports):
            web_env = env | {"HYPNOS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
            procs.append(start(f"daphne-quotas-{i}", ["-m", "hypnos_site.serve"], web_env, directory))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_ready(url, *procs)
        yield Pair(urls, procs)
    finally:
        stop_all(procs)
        _drop_database(database)
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS.get(key, key)}"}


def note(pair: Pair, key: str, response: httpx.Response, stream: bool, body: bytes) -> Call:
    """Put a finished call in the ledger, with the usage its body states."""
    usage, code = None, None
    if response.status_code == 200 and stream:
        finals = [line for line in body.decode().split("\n\n") if '"usage"' in line]
        usage = json.loads(finals[-1].removeprefix("data: "))["usage"]
    elif response.status_code == 200:
        usage = response.json()["usage"]
    else:
        code = response.json()["error"]["code"]
    call = Call(key, response.headers["x-request-id"], response.status_code, usage, stream, code)
    pair.ledger.append(call)
    return call


async def stream_held_open(
    client: httpx.AsyncClient, pair: Pair, i: int, statuses: list[int], release: asyncio.Event
) -> Call:
    """A long stream: a refusal is read whole, an admitted stream is held open until `release`
    and then closed by the client (which gives its permit back)."""
    async with client.stream("POST", pair.url(i) + URL, json=LONG, headers=headers("conc")) as response:
        statuses.append(response.status_code)
        if response.status_code != 200:
            return note(pair, "conc", response, True, await response.aread())
        await release.wait()
    call = Call("conc", response.headers["x-request-id"], 200, None, True, dropped=True)
    pair.ledger.append(call)
    return call


def test_max_concurrent_admits_exactly_two_of_ten_parallel_streams(pair):
    async def batch() -> list[Call]:
        statuses: list[int] = []
        release = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            calls = asyncio.gather(*[stream_held_open(client, pair, i, statuses, release) for i in range(10)])
            # With the model's one slot, the second admitted stream answers only once the first is
            # closed; every other status comes while both streams hold their permits.
            deadline = time.monotonic() + 60
            while len(statuses) < 9 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            release.set()
            return list(await calls)

    calls = asyncio.run(batch())
    assert sorted(c.status for c in calls) == [200] * 2 + [429] * 8
    assert {c.code for c in calls if c.status == 429} == {"max_concurrent"}
    # Both permits come back once the server has seen the client close the streams: the key streams
    # again, on either process (a retry that comes too early is a call like any other).
    for i in range(2):
        deadline = time.monotonic() + 30
        while True:
            with httpx.stream(
                "POST", pair.url(i) + URL, json=SHORT | {"stream": True}, headers=headers("conc"), timeout=60
            ) as response:
                call = note(pair, "conc", response, True, response.read())
            if call.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert call.status == 200


def test_requests_per_minute_is_exact_across_the_processes(pair):
    async def batch() -> list[tuple[httpx.Response, bytes]]:
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(
                *[client.post(pair.url(i) + URL, json=SHORT, headers=headers("rpm")) for i in range(8)]
            )
            return [(r, r.content) for r in responses]

    answered = asyncio.run(batch())
    calls = [note(pair, "rpm", response, False, body) for response, body in answered]
    assert sorted(c.status for c in calls) == [200] * 5 + [429] * 3
    refused = [r for r, _ in answered if r.status_code == 429]
    assert {r.json()["error"]["code"] for r in refused} == {"requests_per_minute"}
    assert all(1 <= int(r.headers["Retry-After"]) <= 60 for r in refused)


def test_tokens_per_day_reached_is_a_429_until_midnight_utc(pair):
    with httpx.stream(
        "POST", pair.url(0) + URL, json=SHORT | {"stream": True}, headers=headers("tpd"), timeout=60
    ) as response:
        assert response.status_code == 200
        note(pair, "tpd", response, True, response.read())
    # The stream was charged when it ended: the other process refuses the key's next call.
    for i in (1, 0):
        refused = httpx.post(pair.url(i) + URL, json=SHORT, headers=headers("tpd"), timeout=60)
        note(pair, "tpd", refused, False, refused.content)
        assert refused.status_code == 429
        assert refused.json()["error"] == refused.json()["error"] | {
            "type": "rate_limit_error",
            "code": "tokens_per_day",
        }
        assert abs(int(refused.headers["Retry-After"]) - secs_to_midnight(time.time())) <= 5


def test_one_keys_mixed_calls_go_through_either_process(pair):
    for i, body in enumerate([SHORT, SHORT | {"stream": True}, SHORT | {"model": "nope"}, SHORT | {"max_tokens": 3}]):
        with httpx.stream("POST", pair.url(i) + URL, json=body, headers=headers("plain"), timeout=60) as response:
            call = note(pair, "plain", response, bool(body.get("stream")), response.read())
        assert call.status == (404 if body["model"] == "nope" else 200)


def log_of(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/logs?limit=200", headers=headers(ADMIN), timeout=30)
    assert response.status_code == 200
    return response.json()


def test_every_call_appears_exactly_once_in_the_log(pair):
    assert pair.ledger, "the module's calls run first"
    first, second = log_of(pair.url(0)), log_of(pair.url(1))
    assert first["records"] == second["records"]
    assert first["stored"] == len(pair.ledger)  # the polls of the log itself are not in it
    ids = [r["id"] for r in first["records"]]
    assert sorted(ids) == sorted(c.request_id for c in pair.ledger)
    by_id = {r["id"]: r for r in first["records"]}
    for call in pair.ledger:
        record = by_id[call.request_id]
        assert (record["status"], record["key"], record["stream"]) == (call.status, call.key, call.stream)
        if call.usage:
            assert (record["tokens_in"], record["tokens_out"]) == (
                call.usage["prompt_tokens"],
                call.usage["completion_tokens"],
            )
        else:
            assert record["tokens_in"] is None and record["error"]
    assert not any(key in str(first) for key in KEYS.values())
    one = httpx.get(f"{pair.url(1)}/v1/logs/{pair.ledger[0].request_id}", headers=headers(ADMIN), timeout=30)
    assert one.json() == by_id[pair.ledger[0].request_id]


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    # The hypnos_api_key_* families are shown to admin keys only.
    response = httpx.get(f"{url}/metrics", headers=headers(ADMIN), timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_the_metrics_of_both_processes_match_the_calls_made(pair):
    assert pair.ledger, "the module's calls run first"
    first, second = scrape(pair.url(0)), scrape(pair.url(1))
    # The per-key counters are the whole server's, whichever process is scraped.
    for name in [n for n in first if n.startswith("hypnos_api_key_")]:
        assert first[name] == second[name], name
    for key in KEYS:
        calls = [c for c in pair.ledger if c.key == key]
        if not calls:
            continue
        label = (("key", key),)
        tokens = sum(c.usage["total_tokens"] for c in calls if c.usage)
        assert first["hypnos_api_key_requests_total"][label] == len(calls)
        assert first["hypnos_api_key_rejections_total"].get(label, 0) == sum(c.status == 429 for c in calls)
        charged = first["hypnos_api_key_tokens_total"].get(label, 0)
        assert first["hypnos_api_key_tokens_today"].get(label, 0) == charged
        if any(c.dropped for c in calls):
            assert charged >= tokens  # plus the deltas the dropped streams had delivered
        else:
            assert charged == tokens
    chat = "/v1/chat/completions"
    for status_class in ("2xx", "4xx"):
        made = sum(f"{c.status // 100}xx" == status_class for c in pair.ledger)
        assert second["hypnos_http_requests_total"][(("class", status_class), ("route", chat))] == made
    # django-prometheus's own families, added up over both processes (PROMETHEUS_MULTIPROC_DIR).
    refused = sum(c.status == 429 for c in pair.ledger)
    assert first["django_http_responses_total_by_status_total"][(("status", "429"),)] == refused
    assert second["django_http_responses_total_by_status_total"][(("status", "429"),)] == refused
    model = (("model", "smollm2-135m"),)
    assert first["hypnos_worker_up"][()] == 1 and first["hypnos_model_tier"][model] == 1
    assert first["hypnos_model_active_leases"][model] == 0
    assert first["hypnos_model_requests_total"][model] == sum(c.status == 200 for c in pair.ledger)
