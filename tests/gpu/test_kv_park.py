"""KV parking with the KV cache on the GPU: a conversation parked when its model leaves tier 1
and restored when it returns gives the same greedy answer as one prefilled from scratch."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.gpu.conftest import CONTEXT, MIB

FIRST = [{"role": "user", "content": "Tell me about the sea. " * 6}]


def answer(engine: Any, messages: list[dict[str, str]]) -> tuple[str, Any]:
    from inference.engines.base import ChatWork

    parts: list[str] = []
    work = ChatWork(messages=messages, max_tokens=16, temperature=0.0)
    result = engine.chat(work, threading.Event(), lambda text, *_: parts.append(text))
    return "".join(parts), result


def test_a_parked_conversation_restored_on_the_gpu_answers_the_same(engine, cuda_context, figures) -> None:
    from memory.kv_park import KvParking

    # Every layer (and so every layer's KV) on the GPU: n_gpu_layers counts the output layer too,
    # so n_layers, what the worker passes for a whole placement, keeps layer 0 on the host.
    layers = engine.footprint().n_layers + 1
    parking = KvParking(enabled=True, max_bytes=1024 * MIB)
    engine.load(CONTEXT, layers)
    first, _ = answer(engine, FIRST)
    history = [*FIRST, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    started = time.perf_counter()
    state = engine.park()
    park_ms = (time.perf_counter() - started) * 1000
    assert state is not None and state.size > 0 and parking.park("gpu-check", state)
    engine.unload()
    engine.load(CONTEXT, layers)
    taken = parking.take("gpu-check", engine.kv_layout())
    assert taken is not None
    started = time.perf_counter()
    restored = engine.restore(taken)
    restore_ms = (time.perf_counter() - started) * 1000
    parked_answer, parked = answer(engine, history)
    engine.unload()
    engine.load(CONTEXT, layers)
    cold_answer, cold = answer(engine, history)
    figures.update(
        state_bytes=state.size,
        tokens=state.tokens,
        restored_tokens=restored,
        park_ms=round(park_ms, 2),
        restore_ms=round(restore_ms, 2),
        parked_cached_tokens=parked.cached_tokens,
        parked_prefill_ms=round(parked.prefill_ms, 2),
        cold_prefill_ms=round(cold.prefill_ms, 2),
    )
    assert restored == state.tokens > 0
    assert parked.cached_tokens > 0 and cold.cached_tokens == 0
    assert parked_answer == cold_answer and len(parked_answer) > 0
