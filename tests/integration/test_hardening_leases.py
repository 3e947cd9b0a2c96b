"""Leases and timeouts (issue 12): an abandoned request gives its model's room up at once, and an
engine-side timeout is the spec's 504 `timeout` (§4).

The prompts are long on purpose: SmolLM2 evaluates a few hundred prompt tokens for about a second
on these cores (idle; many times that when other processes share them), and no cancel flag is
looked at before the first token, so the engine is still busy when the client goes away or the
timeout passes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from inference.worker import Worker
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, read_sse, wait_until, with_limits
from tests.integration.test_tiers import started, tight_config

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
URL = "/v1/chat/completions"


def long_prompt(first_word: str, words: int) -> list[dict[str, str]]:
    """About `words` tokens; a different first word shares no cached prefix with another."""
    return [{"role": "user", "content": f"{first_word}. Count the words: " + "one two three four five " * (words // 5)}]


@pytest.fixture
def tight(settings, use_worker) -> Iterator[Worker]:
    """SmolLM2 and Qwen2.5-Coder-0.5B under a budget that holds one of them (test_tiers.py)."""
    worker = use_worker(started(Worker(tight_config(settings.HYPNOS))))
    yield worker
    worker.shutdown()


async def test_it_releases_the_lease_of_an_abandoned_stream_at_once(api, tight):
    warm = await post_json(api, URL, {"model": SMOL, "messages": long_prompt("Warm", 300), "max_tokens": 1})
    assert warm.status_code == 200, warm.content  # loaded with the context the long prompt needs
    runtime = tight.models[SMOL]
    stream = await post_json(
        api, URL, {"model": SMOL, "messages": long_prompt("Go", 300), "max_tokens": 50, "stream": True}
    )
    assert stream.status_code == 200
    reader, chunks = read_in_background(stream)
    try:
        # The role chunk is out and the engine is evaluating the prompt.
        assert await wait_until(lambda: runtime.engine_users == 1 and len(chunks) >= 1, timeout=30)
    finally:
        reader.cancel()  # what a client disconnect does to the response
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    # Released by the abort itself, not when the engine reaches its next token.
    assert tight.tiers.entries[SMOL].leases == 0
    answer = await post_json(api, URL, {"model": QWEN, "messages": PARIS_MESSAGES, "max_tokens": 4})
    assert answer.status_code == 200, answer.content
    assert answer.json()["hypnos_telemetry"]["evicted_models"] == [SMOL]
    assert runtime.engine_users == 0 and runtime.admitted == 0
    assert tight.tiers.entries[SMOL].tier != "tier1_gpu_vram"


async def test_a_stream_whose_prompt_takes_longer_than_the_request_timeout_is_not_cut(api, worker, settings):
    """Spec §4: request_timeout_secs bounds the time to the response headers; a stream's body
    runs as long as max_tokens takes, its prompt's evaluation included (once it was cut after the
    role chunk: "the engine produced nothing for 1.5 s")."""
    warm = await post_json(api, URL, {"model": SMOL, "messages": long_prompt("Warm", 1000), "max_tokens": 1})
    assert warm.status_code == 200, warm.content
    # The prompt below takes seconds to evaluate; a token after it, tens of milliseconds.
    with_limits(settings, request_timeout_secs=1.0)
    stream = await post_json(
        api, URL, {"model": SMOL, "messages": long_prompt("Go", 1000), "max_tokens": 8, "stream": True}
    )
    assert stream.status_code == 200
    events = await read_sse(stream)
    assert events[-1] == "[DONE]"
    assert all("error" not in e for e in events[:-1]), events
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length"), events[-2]


async def test_a_tier_move_longer_than_the_request_timeout_is_a_202_and_goes_on(api, tight, settings):
    with_limits(settings, request_timeout_secs=0.05)
    response = await post_json(api, "/v1/memory/tier", {"model": QWEN, "target_tier": "tier1_gpu_vram"})
    assert response.status_code == 202, response.content
    assert response["x-request-id"].startswith("req-")
    assert response["location"] == "/v1/memory/status"
    moving = response.json()
    assert moving["model"] == QWEN and moving["target_tier"] == "tier1_gpu_vram" and moving["status"] == "moving"
    assert "request_timeout_secs" in moving["message"] and "/v1/memory/status" in moving["message"]
    # The load goes on in the worker and ends in tier 1, as the 202 said.
    assert await wait_until(
        lambda: tight.tiers.entries[QWEN].tier == "tier1_gpu_vram" and not tight.tiers.entries[QWEN].leases, timeout=60
    )
