"""Execution slots sharing decode steps on the real SmolLM2 (slots = 3)."""

from __future__ import annotations

import asyncio
import json

import pytest

from inference.worker import Worker
from tests.integration.conftest import post_json, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SMOL = "smollm2-135m"
URL = "/v1/chat/completions"
PROMPTS = ["Name three fruits.", "Write a haiku about snow.", "What is a CPU?", "Tell me a fun fact about cats."]
# What each answer must be about: sequences decoded together must not leak into each other.
TOPICS = [("apple", "banana", "orange", "fruit"), ("snow",), ("cpu", "processor", "central"), ("cat",)]


@pytest.fixture
def three_slots(settings, serve) -> Worker:
    model = settings.HYPNOS.models[0].model_copy(update={"slots": 3})
    config = settings.HYPNOS.model_copy(
        update={"models": [model], "limits": settings.HYPNOS.limits.model_copy(update={"max_queue_per_model": 4})}
    )
    return serve(config)


def request(prompt: str, **extra: object) -> dict:
    return {
        "model": SMOL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }


async def test_four_streams_on_three_slots_batch_three_and_queue_one(api, three_slots):
    together = await asyncio.gather(*[post_json(api, URL, request(p, stream=True)) for p in PROMPTS])
    finals = []
    for response, topics in zip(together, TOPICS, strict=False):
        events = [
            line
            for line in b"".join([c async for c in response.streaming_content]).decode().split("\n\n")
            if line.startswith("data: {")
        ]
        chunks = [json.loads(e[len("data: ") :]) for e in events]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert any(topic in text.lower() for topic in topics), text
        finals.append(chunks[-1])
    assert all(0 < f["usage"]["completion_tokens"] <= 24 for f in finals)
    slots = sorted(f["hypnos_telemetry"]["engine"]["concurrent_slots"] for f in finals)
    assert slots[-1] == 3
    waited = sorted(f["hypnos_telemetry"]["engine"]["queue_ms"] for f in finals)
    assert waited[-1] > 10 * max(waited[0], 1)  # the fourth waited for a slot


async def test_a_seeded_request_alone_is_reproducible(api, three_slots):
    body = request(PROMPTS[1], seed=7, temperature=0.8)
    first = (await post_json(api, URL, body)).json()["choices"][0]["message"]["content"]
    second = (await post_json(api, URL, body)).json()["choices"][0]["message"]["content"]
    assert first == second


async def test_a_slot_reuses_its_conversation_prefix(api, three_slots):
    history = [{"role": "system", "content": "You are terse. " * 30}, {"role": "user", "content": "Hi"}]
    first = (await post_json(api, URL, {"model": SMOL, "messages": history, "max_tokens": 4})).json()
    history += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    second = (await post_json(api, URL, {"model": SMOL, "messages": history, "max_tokens": 4})).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1


async def test_a_cancelled_request_frees_its_slot_at_once(api, three_slots):
    body = {
        "model": SMOL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 2000,
        "stream": True,
    }
    responses = [await post_json(api, URL, body) for _ in range(3)]
    chunks: list[list[bytes]] = [[], [], []]

    async def consume(i: int) -> None:
        async for chunk in responses[i].streaming_content:
            chunks[i].append(chunk)

    readers = [asyncio.create_task(consume(i)) for i in range(3)]
    try:
        assert await wait_until(lambda: all(len(c) >= 2 for c in chunks), timeout=60)
        readers[0].cancel()
        # A slot held on would free only when its 2000 tokens end (minutes, three streams on this box).
        assert await wait_until(lambda: three_slots.models[SMOL].admitted == 2, timeout=15)
        quick = await post_json(api, URL, request("Hi", max_tokens=2))
        assert quick.status_code == 200
        assert quick.json()["hypnos_telemetry"]["engine"]["queue_ms"] < 10_000
    finally:
        for reader in readers:
            reader.cancel()


def _answer(response) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]


async def test_a_single_stream_after_concurrent_ones_runs_on_a_compacted_kv(api, three_slots):
    """After a round of concurrent streams, the next one alone clears the KV of the others'
    interleaved cells (their sequences wait in host memory), answers as it did before the round,
    and each stashed conversation still finds its prefix."""
    alone = [_answer(await post_json(api, URL, request(p))) for p in PROMPTS[:3]]
    await asyncio.gather(*[post_json(api, URL, request(p)) for p in PROMPTS[:3]])
    scheduler = three_slots.models[SMOL].engine._scheduler  # type: ignore[union-attr]

    again, usage = _answer(await post_json(api, URL, request(PROMPTS[0])))
    assert again == alone[0][0]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    stashed = [slot for slot in scheduler.slots if slot.stash is not None]
    assert len(stashed) == 2 and all(slot.tokens for slot in stashed)
    # KV parking takes a stashed sequence from host memory as it takes the others from the KV.
    assert len(scheduler.park()) == 3

    for prompt, topics in zip(PROMPTS[1:3], TOPICS[1:3], strict=True):
        text, usage = _answer(await post_json(api, URL, request(prompt)))
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert any(topic in text.lower() for topic in topics), text
    # Each ran alone, so each left only its own sequence in the KV.
    assert [slot.stash is None for slot in scheduler.slots].count(True) == 1


async def test_a_background_job_gives_way_while_an_interactive_prompt_is_evaluated(api, three_slots):
    """A batch's line (SlotJob.background) decoding on one slot sits out the steps of an
    interactive job's prompt: from the interactive job's arrival to its first token the
    background job adds at most the token of the step already in flight, where sharing the
    steps it would add one per prompt chunk (a 1,500-token prompt: three chunks, four tokens)."""
    import threading

    from inference.engines.llama_slots import BATCH_TOKENS, SlotJob
    from inference.engines.text import StopMatcher

    assert (await post_json(api, URL, request(PROMPTS[0], max_tokens=1))).status_code == 200  # in tier 1
    scheduler = three_slots.models[SMOL].engine._scheduler  # type: ignore[union-attr]
    llm = scheduler.llm
    background_tokens: list[int] = []
    at_arrival: list[int] = []
    at_first_token: list[int] = []
    background_started = threading.Event()

    def job(tokens: list[int], max_tokens: int, background: bool, emit) -> SlotJob:  # type: ignore[no-untyped-def]
        return SlotJob(
            tokens=tokens,
            sampler=llm._init_sampler(temp=0.0),
            stops=StopMatcher([]),
            max_tokens=max_tokens,
            cancel=threading.Event(),
            emit=emit,
            background=background,
        )

    def on_background(text: str, token: int, index: int) -> None:
        background_tokens.append(token)
        background_started.set()

    def on_interactive(text: str, token: int, index: int) -> None:
        if not at_first_token:
            at_first_token.append(len(background_tokens))

    story = llm.tokenize(
        b"<|im_start|>user\nWrite a very long story about a dragon and a knight.<|im_end|>\n<|im_start|>assistant\n",
        special=True,
    )
    bulk = job(story, 400, True, on_background)
    runner = threading.Thread(target=scheduler.run, args=(bulk,), daemon=True)
    runner.start()
    try:
        assert await asyncio.to_thread(background_started.wait, 60), (bulk.error, bulk.result)
        prompt = llm.tokenize(b" cat" * (3 * BATCH_TOKENS - 36))
        assert 2 * BATCH_TOKENS < len(prompt) <= 3 * BATCH_TOKENS
        interactive = job(prompt, 2, False, on_interactive)
        # Queued as SlotScheduler.run queues it, the background job's count taken under the same
        # lock: only the step in flight can add a token before the next admission.
        with scheduler.cond:
            at_arrival.append(len(background_tokens))
            scheduler.queue.append(interactive)
            scheduler.cond.notify()
        assert await asyncio.to_thread(interactive.done.wait, 120)
        assert interactive.error is None and interactive.result is not None and at_first_token
        assert not bulk.done.is_set(), "the background job must still be running to be measured"
        assert at_first_token[0] - at_arrival[0] <= 1, (at_arrival, at_first_token)
    finally:
        bulk.cancel.set()
        await asyncio.to_thread(runner.join, 60)
