"""Abandoned work stops at its next step (issue 35 item 2): a prompt is evaluated a batch at a
time with the request's cancel flag looked at between batches (llama-cpp-python evaluates a
whole prompt in one call nothing stops), and entity extraction looks at it between texts (a
request of 3,000 texts kept a core busy 711 s after its client left). Real SmolLM2, driven
directly: the cancel comes at a step the test chooses, not at a moment it guesses."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hypnos_site.config import LimitsConfig
from hypnos_site.errors import Cancelled
from inference.engines.base import ChatWork
from inference.engines.llama import LlamaEngine
from inference.transport.wire import EntityWork
from inference.worker.entities import ChatExtractor
from inference.worker.tier_moves import TierSwitch
from memory.tiers import MemoryTier


class CancelAfter(threading.Event):
    """A cancel flag that reads as set from its `asks`+1-th look on: what a client that leaves
    during the `asks`-th step does."""

    def __init__(self, asks: int):
        super().__init__()
        self.asks = asks

    def is_set(self) -> bool:
        self.asks -= 1
        return self.asks < 0 or super().is_set()


@pytest.fixture
def engine(settings) -> Iterator[LlamaEngine]:
    model = settings.HYPNOS.models[0]  # SmolLM2, 2048 tokens of context
    loaded = LlamaEngine(model, settings.HYPNOS.weights_file(model), None)
    loaded.load(2048, 0)
    yield loaded
    loaded.unload()


def ignore(*_: object) -> None:
    return None


def test_a_long_prompt_stops_between_two_batches_when_its_client_leaves(engine):
    work = ChatWork(messages=[{"role": "user", "content": "one two three four five " * 300}], max_tokens=4)
    llm = engine._llm
    assert llm is not None
    result = engine.chat(work, CancelAfter(1), ignore)
    assert result.finish_reason == "cancelled" and result.completion_tokens == 0
    assert result.prompt_tokens > 2 * llm.n_batch  # the prompt is three batches and some
    assert llm.n_tokens == llm.n_batch  # one batch was evaluated, not the whole prompt
    # Not cancelled, the same prompt is answered, the batch evaluated before reused.
    answered = engine.chat(work, threading.Event(), ignore)
    assert answered.finish_reason in ("stop", "length")
    assert answered.cached_tokens >= llm.n_batch


def test_entity_extraction_stops_between_texts_when_its_client_leaves(engine):
    cancel = threading.Event()
    prepared: list[ChatWork] = []

    def prepare(chat: ChatWork) -> tuple[ChatWork, TierSwitch]:
        prepared.append(engine.prepare_chat(chat, LimitsConfig()))
        engine.check_context(prepared[-1])
        if len(prepared) == 10:
            cancel.set()  # the client leaves while the tenth text is prepared
        return prepared[-1], TierSwitch(previous_tier=MemoryTier.TIER1)

    texts = [f"Marie Curie worked in Paris in {1890 + i}." for i in range(40)]
    work = EntityWork(input=texts, labels=["person", "city"])
    with pytest.raises(Cancelled):
        ChatExtractor(engine, work, cancel, prepare).prepare()
    assert len(prepared) == 10
    # Gone during the extraction: the next text is not started.
    cancel.clear()
    extractor = ChatExtractor(engine, work, cancel, prepare)
    extractor.prepare()
    first = extractor.extract(0)
    assert any(span.label == "person" for span in first), first
    spent = extractor.prompt_tokens
    cancel.set()
    with pytest.raises(Cancelled):
        extractor.extract(1)
    assert extractor.prompt_tokens == spent
