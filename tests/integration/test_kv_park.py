"""KV parking with the real SmolLM2: a conversation parked when its model leaves tier 1 is
restored when it returns, so the next turn evaluates only its new tokens."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import llama_cpp
import pytest

from inference.worker import Worker
from tests.integration.conftest import post_json, wait_until

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
def parking_worker(settings, serve) -> Worker:
    config = settings.HYPNOS.model_copy(
        update={
            "models": settings.HYPNOS.models[:1],
            "hardware": settings.HYPNOS.hardware.model_copy(update={"kv_park": True}),
        }
    )
    return serve(config)


async def turn(api, messages: list[dict]) -> dict:
    response = await post_json(api, URL, {"model": SMOL, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.content
    return response.json()


async def swap_out_and_back(api) -> None:
    assert (
        await post_json(api, "/v1/memory/tier", {"model": SMOL, "target_tier": "tier2_pinned_ram"})
    ).status_code == 200


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


def parking_config(settings, slots: int = 1, idle_secs: float | None = None):
    return settings.HYPNOS.model_copy(
        update={
            "models": [settings.HYPNOS.models[0].model_copy(update={"slots": slots})],
            "hardware": settings.HYPNOS.hardware.model_copy(update={"kv_park": True}),
            "server": settings.HYPNOS.server.model_copy(update={"kv_idle_timeout_secs": idle_secs}),
        }
    )


@pytest.fixture
def idle_timeout_worker(settings, serve) -> Worker:
    return serve(parking_config(settings, idle_secs=1.0))


@pytest.fixture
def two_slot_worker(settings, serve) -> Worker:
    return serve(parking_config(settings, slots=2))


def kv_tokens(worker: Worker) -> int:
    """The tokens in the KV of the model's one slot (0 once emptied)."""
    engine = worker.models[SMOL].engine
    assert engine is not None
    return int(engine._llm.n_tokens)


def cached(response: dict) -> int:
    return response["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


async def test_a_conversation_idle_past_the_timeout_is_emptied_and_not_parked(api, idle_timeout_worker):
    history = [SYSTEM, {"role": "user", "content": "Name a color."}]
    first = await turn(api, history)
    again = await turn(api, history)  # within the timeout the prefix is reused
    assert cached(again) >= first["usage"]["prompt_tokens"] - 1
    # The sweep (every 0.25 s here) empties the slot after 1 s idle.
    assert await wait_until(lambda: kv_tokens(idle_timeout_worker) == 0, timeout=30)
    assert cached(await turn(api, history)) == 0
    assert await wait_until(lambda: kv_tokens(idle_timeout_worker) == 0, timeout=30)
    await swap_out_and_back(api)
    assert (await api.get("/v1/memory/kv-park")).json()["models"] == []


async def test_every_used_slot_is_parked_and_restored_to_its_sequence(api, two_slot_worker):
    # Both requests run at once, so each holds its own slot (sequence 0 and 1).
    conversations = [
        [SYSTEM, {"role": "user", "content": "List five fruits and say why you like each."}],
        [SYSTEM, {"role": "user", "content": "List five countries and their capitals."}],
    ]
    bodies = [{"model": SMOL, "messages": c, "max_tokens": 40, "temperature": 0} for c in conversations]
    firsts = [r.json() for r in await asyncio.gather(*[post_json(api, URL, b) for b in bodies])]
    assert max(f["hypnos_telemetry"]["engine"]["concurrent_slots"] for f in firsts) == 2
    await swap_out_and_back(api)
    [parked] = (await api.get("/v1/memory/kv-park")).json()["models"]
    assert parked["slots"] == 2
    assert parked["tokens"] >= sum(f["usage"]["prompt_tokens"] for f in firsts)

    seconds = []
    for conversation, first in zip(conversations, firsts, strict=True):
        history = conversation + [first["choices"][0]["message"], {"role": "user", "content": "Thanks!"}]
        seconds.append(await turn(api, history))
    phases = seconds[0]["hypnos_telemetry"]["tier_switch_phases"]
    assert phases["kv_restored_tokens"] == parked["tokens"]
    for first, second in zip(firsts, seconds, strict=True):
        # Each conversation found its whole previous prompt in the slot it was restored to.
        assert cached(second) >= first["usage"]["prompt_tokens"]


def restarting_config(settings, data_dir) -> Any:
    config = parking_config(settings)
    return config.model_copy(
        update={
            "hardware": config.hardware.model_copy(update={"kv_park_across_restarts": True}),
            # Its own data folder (where the parked states go), the suite's models all the same.
            "server": config.server.model_copy(
                update={"data_dir": str(data_dir), "models_dir": str(config.models_dir)}
            ),
        }
    )


async def test_a_conversation_survives_a_worker_restart(api, settings, serve, tmp_path, evaluated):
    """A stopping worker writes its tier-1 model's conversation to disk; the worker started next
    takes it back as it stages the model, so the next turn prefills only its new tokens."""
    config = restarting_config(settings, tmp_path)
    first_worker = serve(config)
    history = [SYSTEM, {"role": "user", "content": "Name a color."}]
    first = await turn(api, history)
    history += [first["choices"][0]["message"], {"role": "user", "content": "Name another one."}]
    await asyncio.to_thread(first_worker.shutdown)
    [saved] = list(first_worker.parked_states_dir.glob("*.kvpark"))
    assert saved.stat().st_size > 0

    serve(config)  # routes the views to the new worker; staging restores the conversation
    assert not saved.exists()  # taken: a third worker does not restore it again
    assert (await api.get("/v1/memory/kv-park")).json()["models"] == []
    evaluated.clear()
    second = await turn(api, history)
    assert cached(second) >= first["usage"]["prompt_tokens"]
    assert evaluated[0] < 40 < second["usage"]["prompt_tokens"]


async def test_a_damaged_parked_state_is_dropped_and_the_worker_serves(api, settings, serve, tmp_path, caplog):
    config = restarting_config(settings, tmp_path)
    folder = tmp_path / "kv-park" / (config.server.worker_id or socket.gethostname())
    folder.mkdir(parents=True)
    (folder / "cut.kvpark").write_bytes(b'HYPNOS-KV-PARK 1\n\x00\x00\x00\x00\x00\x00\x00\x40{"model"')
    (folder / "other.kvpark").write_bytes(b"not a parked state")
    worker = serve(config)
    assert worker.parked_states_dir == folder
    assert list(folder.iterdir()) == []
    assert "dropping the parked KV state" in caplog.text
    answer = await turn(api, [SYSTEM, {"role": "user", "content": "Name a color."}])
    assert cached(answer) == 0 and answer["choices"][0]["message"]["content"]
