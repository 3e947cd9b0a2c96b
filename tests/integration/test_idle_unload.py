"""Idle unload (server.keep_alive_secs, Ollama's keep_alive): a model left idle in tier 1 past
its keep-alive is demoted by the worker, to tier 2 while the warm budget holds it, and the next
request brings it back; a model that serves is never unloaded under it."""

from __future__ import annotations

import asyncio

import pytest

from inference.worker import Worker
from memory.tiers import MemoryTier
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, wait_until, with_limits

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
URL = "/v1/chat/completions"


@pytest.fixture
def idle_unload(settings, serve) -> Worker:
    # Long enough answers for the second test (the suite caps max_tokens at 64).
    config = with_limits(settings, max_tokens_cap=400)
    server = config.server.model_copy(update={"keep_alive_secs": 1.0})
    return serve(config.model_copy(update={"models": config.models[:1], "server": server}))


def ask(max_tokens: int = 2) -> dict:
    return {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": max_tokens, "temperature": 0}


async def _row(api) -> dict:  # type: ignore[no-untyped-def]
    return next(r for r in (await api.get("/v1/memory/status")).json()["models"] if r["id"] == SMOL)


async def test_an_idle_model_leaves_tier_1_after_its_keep_alive_and_comes_back(api, idle_unload):
    assert (await post_json(api, URL, ask())).status_code == 200
    row = await _row(api)
    assert row["current_tier"] == "tier1_gpu_vram" and row["keep_alive_secs"] == 1.0 and row["expires_at"]
    assert await wait_until(lambda: idle_unload.tiers.tier(SMOL) == MemoryTier.TIER2, timeout=30)
    status = (await api.get("/v1/memory/status")).json()
    assert status["recent_evictions"][0] | {"unix_ms": 0} == {
        "model": SMOL,
        "for_model": None,
        "reason": "idle",
        "to_tier": "tier2_pinned_ram",
        "unix_ms": 0,
        "worker": status["workers"][0]["worker_id"],
    }
    assert (await _row(api))["expires_at"] is None
    back = (await post_json(api, URL, ask())).json()
    assert back["hypnos_telemetry"]["previous_tier"] == "tier2_pinned_ram"
    assert back["choices"][0]["message"]["content"]


async def test_a_model_that_serves_past_its_keep_alive_stays(api, idle_unload):
    """A stream longer than the keep-alive holds its lease: nothing unloads it mid-answer."""
    story = {**ask(max_tokens=300), "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    slow = asyncio.create_task(post_json(api, URL, story))
    started, tiers = asyncio.get_running_loop().time(), []
    while not slow.done():
        tiers.append(idle_unload.tiers.tier(SMOL))
        await asyncio.sleep(0.1)
    answer = (await slow).json()
    # The answer outlived the 1 s keep-alive, and the model stayed in tier 1 throughout.
    assert asyncio.get_running_loop().time() - started > 1.5, answer["usage"]
    assert set(tiers) == {MemoryTier.TIER1}
