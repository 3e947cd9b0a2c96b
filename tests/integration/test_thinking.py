"""Thinking (spec §7.1, §7.2, §7.4; compat.md aliases) on the real SmolLM2.

No model that was trained to think in a <think> block ships on any package registry these
machines reach. SmolLM2 stands in, configured with `thinking = "think_tags"`: the server opens
the block, routes what the model writes there to reasoning_content, and closes it when the
budget is spent. What the model thinks is not meaningful; the tests assert the mechanics: the
thoughts come first and apart from the answer, no tag reaches the client, the budget holds and
an answer follows the forced close.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from django.core.asgi import get_asgi_application

from inference.worker import Worker
from tests.integration.conftest import post_json, read_sse

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/v1/chat/completions"
SMOL = "smollm2-135m"
THINKER = "smollm2-thinking"
LOW_BUDGET = 512
# A request that keeps SmolLM2 writing well past the low budget without ending its turn
# (measured at temperature 0: past 560 tokens; "Count from 1 to 400" ends after 17).
LONG = [{"role": "user", "content": "Write a very long story about a dragon, at least 2000 words."}]
# A request after which SmolLM2 ends its turn inside the block (17 tokens): the server closes it.
SHORT = [{"role": "user", "content": "Count from 1 to 400, one number per line."}]


@pytest.fixture(params=[1], ids=["one-slot"])
def thinker(request, settings, serve) -> Worker:
    """SmolLM2 twice: as configured (no thinking format) and as `smollm2-thinking` (on
    request.param execution slots)."""
    smol = next(m for m in settings.HYPNOS.models if m.id == SMOL)
    thinker = smol.model_copy(
        update={
            "id": THINKER,
            "aliases": [],
            "thinking": "think_tags",
            "slots": request.param,
            "initial_tier": "tier3_nvme_ssd",
            "speech_to_text_model": None,
        }
    )
    config = settings.HYPNOS.model_copy(
        update={"models": [smol, thinker], "limits": settings.HYPNOS.limits.model_copy(update={"max_tokens_cap": 1024})}
    )
    settings.HYPNOS = config
    return serve(config)


def tokens(worker: Worker, text: str) -> int:
    engine = worker.models[THINKER].engine
    assert engine is not None and engine._llm is not None
    return len(engine._llm.tokenize(text.encode(), add_bos=False, special=False))


def ask(model: str, max_tokens: int, **extra: object) -> dict:
    return {"model": model, "messages": LONG, "max_tokens": max_tokens, "temperature": 0, **extra}


async def test_the_low_budget_closes_the_thoughts_and_an_answer_follows(api, thinker):
    response = await post_json(api, URL, ask(THINKER, LOW_BUDGET + 40, reasoning_effort="low"))
    assert response.status_code == 200, response.content
    body = response.json()
    message = body["choices"][0]["message"]
    thoughts, answer = message["reasoning_content"], message["content"]
    # The thoughts filled the budget (the server closed the block, the model did not) ...
    assert LOW_BUDGET - 16 <= tokens(thinker, thoughts) <= LOW_BUDGET + 4
    # ... and the model went on to answer within max_tokens, which covers both.
    assert answer.strip()
    assert body["usage"]["completion_tokens"] <= LOW_BUDGET + 40
    assert "<think>" not in answer + thoughts and "</think>" not in answer + thoughts


@pytest.mark.parametrize("thinker", [1, 2], ids=["one-slot", "slot-scheduler"], indirect=True)
async def test_streamed_thoughts_come_before_the_answer_when_the_model_ends_inside_them(api, thinker):
    body = ask(THINKER, 64, think=False, enable_thinking=True, reasoning_effort="low", stream=True)
    body["messages"] = SHORT
    response = await post_json(api, URL, body)
    events = await read_sse(response)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    kinds = ["reasoning" if "reasoning_content" in d else "content" for d in deltas if d]
    first_content = kinds.index("content")
    assert first_content > 0 and "reasoning" not in kinds[first_content:]
    thoughts = "".join(d.get("reasoning_content", "") for d in deltas)
    answer = "".join(d.get("content", "") for d in deltas)
    assert thoughts.strip() and answer.strip()
    assert "think>" not in thoughts + answer
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_think_without_a_budget_thinks_until_max_tokens(api, thinker):
    body = (await post_json(api, URL, ask(THINKER, 48, think=True))).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].strip() and message["content"] == ""
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 48


async def test_thinking_off_gives_a_plain_answer(api, thinker):
    for off in ({"reasoning_effort": "none"}, {"enable_thinking": False}, {"thinking": False}, {}):
        body = (await post_json(api, URL, ask(THINKER, 16, **off))).json()
        message = body["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"].strip(), off


async def test_a_model_without_a_thinking_format_ignores_the_fields(api, thinker):
    plain = (await post_json(api, URL, ask(SMOL, 16))).json()["choices"][0]["message"]
    asked = (await post_json(api, URL, ask(SMOL, 16, reasoning_effort="high", think=True))).json()
    assert asked["choices"][0]["message"] == plain


async def test_the_openai_sdk_reads_reasoning_content(thinker):
    transport = httpx.ASGITransport(app=get_asgi_application())
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        completion = await client.chat.completions.create(
            model=THINKER, messages=LONG, max_tokens=64, temperature=0, extra_body={"think": True}
        )
    message = completion.choices[0].message
    # reasoning_content is a Hypnos field: the SDK keeps it among the message's extra fields.
    thoughts = (message.model_extra or {}).get("reasoning_content")
    assert thoughts and thoughts.strip()
    assert json.loads(completion.model_dump_json())["choices"][0]["message"]["reasoning_content"] == thoughts


async def test_a_streamed_response_carries_the_thoughts_as_a_reasoning_item_before_the_message(api, thinker):
    body = {
        "model": THINKER,
        "input": SHORT[0]["content"],
        "max_output_tokens": 64,
        "temperature": 0,
        "reasoning": {"effort": "low"},
        "stream": True,
    }
    response = await post_json(api, "/v1/responses", body)
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    # Named events: "event: <type>" then "data: <json>".
    events = [json.loads(block.split("data: ", 1)[1]) for block in raw.split("\n\n") if "data: " in block]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed"
    thoughts = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert thoughts.strip() and answer.strip() and "think>" not in thoughts + answer
    # The reasoning item (index 0) is done before the message (index 1) starts.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"], output
    assert output[0]["content"][0]["text"] == thoughts and output[1]["content"][0]["text"] == answer
