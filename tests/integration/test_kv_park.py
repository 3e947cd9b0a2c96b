"""KV parking with the real SmolLM2: a conversation parked when its model leaves tier 1 is
restored when it returns, so the next turn evaluates only its new tokens."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import pytest

from inference.worker import Worker
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
URL = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " + "Answer briefly and precisely. " * 40}


@pytest.fixture
def evaluated(monkeypatch) -> list[int]:
    """Tokens the engine really evaluates, counted at llama-cpp-python's eval()."""
    counts: list[int] = []
    original = llama_cpp.Llama.eval

    def counting(self, tokens):  # type: ignore[no-untyped-def]
        counts.append(len(tokens))
        return original(self, tokens)

    monkeypatch.setattr(llama_cpp.Llama, "eval", counting)
    return counts


@pytest.fixture
def parking_worker(settings, use_worker) -> Iterator[Worker]:
    config = settings.HYPNOS.model_copy(update={
        "models": settings.HYPNOS.models[:1],
        "hardware": settings.HYPNOS.hardware.model_copy(update={"kv_park": True}),
    })
    worker = use_worker(Worker(config))
    worker.start()
    assert worker.wait_ready(60)
    yield worker
    worker.shutdown()


async def turn(api, messages: list[dict]) -> dict:
    response = await post_json(api, URL, {"model": SMOL, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.content
    return response.json()


async def swap_out_and_back(api) -> None:
    assert (await post_json(api, "/v1/memory/tier", {"model": SMOL, "target_tier": "tier2_pinned_ram"})).status_code == 200


async def test_a_parked_conversation_evaluates_only_its_new_tokens(api, parking_worker, evaluated):
    history = [SYSTEM, {"role": "user", "content": "Name a color."}]
    first = await turn(api, history)
    history += [first["choices"][0]["message"], {"role": "user", "content": "Name another one."}]
    await swap_out_and_back(api)
    status = (await api.get("/v1/memory/kv-park")).json()
    [parked] = status["models"]
    assert parked["model"] == SMOL and parked["tokens"] >= first["usage"]["prompt_tokens"]
    assert status["used_bytes"] == parked["bytes"] > 0

    evaluated.clear()
    second = await turn(api, history)
    phases = second["hypnos_telemetry"]["tier_switch_phases"]
    assert phases["kv_restored_tokens"] == parked["tokens"] and phases["kv_restore_ms"] >= 0
    prefill = evaluated[0]  # the first eval() of the request is its prompt
    assert prefill < 40 < second["usage"]["prompt_tokens"]
    assert (await api.get("/v1/memory/kv-park")).json()["models"] == []


async def test_parking_never_changes_an_answer(api, parking_worker):
    history = [SYSTEM, {"role": "user", "content": "Name a color."}]
    first = await turn(api, history)
    history += [first["choices"][0]["message"], {"role": "user", "content": "Name another one."}]
    await swap_out_and_back(api)
    parked_answer = (await turn(api, history))["choices"][0]["message"]["content"]
    await post_json(api, "/v1/memory/kv-park", {"enabled": False})
    await swap_out_and_back(api)
    cold_answer = (await turn(api, history))["choices"][0]["message"]["content"]
    assert parked_answer == cold_answer


async def test_the_cap_and_the_switch_apply_at_once(api, parking_worker):
    await turn(api, [SYSTEM, {"role": "user", "content": "Hi"}])
    await swap_out_and_back(api)
    assert len((await api.get("/v1/memory/kv-park")).json()["models"]) == 1
    capped = (await post_json(api, "/v1/memory/kv-park", {"max_bytes": 1024})).json()
    assert capped["max_bytes"] == 1024 and capped["models"] == [] and capped["used_bytes"] == 0
    assert (await post_json(api, "/v1/memory/kv-park", {})).status_code == 400
    status = (await api.get("/v1/memory/status")).json()
    assert status["kv_park"]["enabled"] is True and status["kv_park"]["max_bytes"] == 1024
