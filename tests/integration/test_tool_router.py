"""The tool router's pass (tool_choice "auto" on a model with tool_router) keeps the
conversation's KV (issue 34 item 7: the pass evicted it, so every "auto" call evaluated the whole
conversation again, 3-4x the time of a forced call). Qwen2.5-Coder-0.5B stands in for the
router model (the 1.5B routes in tests/e2e/test_chat_features.py): what it decides does not
matter here, only what the context keeps."""

from __future__ import annotations

import pytest

from inference.worker import Worker
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
QWEN = "qwen2.5-coder-0.5b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. " + "Answer briefly and politely. " * 30},
    {"role": "user", "content": "What is the weather in Paris today?"},
]


@pytest.fixture
def routed(settings, serve) -> Worker:
    """Qwen2.5-Coder-0.5B alone, with the tool router on."""
    qwen = next(m for m in settings.HYPNOS.models if m.id == QWEN).model_copy(update={"tool_router": True})
    return serve(settings.HYPNOS.model_copy(update={"models": [qwen]}))


def cached(answer: dict) -> int:
    return answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


async def test_an_auto_call_reuses_the_conversation_after_the_routing_pass(api, routed):
    request = {
        "model": QWEN,
        "messages": CONVERSATION,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "max_tokens": 8,
        "temperature": 0,
    }
    first = await post_json(api, "/v1/chat/completions", request)
    assert first.status_code == 200, first.content
    second = await post_json(api, "/v1/chat/completions", request)
    assert second.status_code == 200, second.content
    usage = second.json()["usage"]
    # Every prompt token but the last (re-evaluated for its logits) comes from the context.
    assert cached(second.json()) == usage["prompt_tokens"] - 1, usage
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    # The router's own prompt is kept beside it: the engine holds both between calls.
    assert routed.models[QWEN].engine._router_kv is not None
