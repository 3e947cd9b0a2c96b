"""The scheduler's two wins, each against its own baseline in the same run:

1. aggregate decode tokens/s of 3 concurrent streams on a 3-slot model (one batched decode per
   step) against 1 stream;
2. the next turn of a long conversation (>= 1,000 tokens) after the model was swapped out and
   back, with KV parking against without.

    .venv/bin/python bench/scheduler.py [--runs 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")
os.environ.setdefault("HYPNOS_LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from inference.transport.wire import Done, EngineRequest, Error, GenerateWork  # noqa: E402
from inference.worker import Worker  # noqa: E402
from memory.tiers import MemoryTier  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [
    "Write a long story about a dragon.",
    "Write a long story about a knight.",
    "Write a long story about a ship.",
]


def chat(worker: Worker, messages: list[dict], max_tokens: int) -> dict:
    """One request through the worker's own admission and engines; its `done` event's usage."""
    done = threading.Event()
    final: list[Done | Error] = []

    def sink(event: object) -> None:
        if isinstance(event, (Done, Error)):
            final.append(event)
            done.set()

    work = GenerateWork(messages=messages, max_tokens=max_tokens, temperature=0.0)
    worker.submit(EngineRequest(request_id=f"bench-{time.monotonic_ns()}", model=MODEL, work=work), sink)
    done.wait()
    assert isinstance(final[0], Done) and final[0].usage is not None, final
    usage = final[0].usage
    return {
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        }
    }


def worker_with(slots: int, kv_park: bool) -> Worker:
    config = settings.HYPNOS
    model = next(m for m in config.models if m.id == MODEL).model_copy(update={"slots": slots, "context_len": 4096})
    worker = Worker(
        config.model_copy(
            update={"models": [model], "hardware": config.hardware.model_copy(update={"kv_park": kv_park})}
        )
    )
    worker._staged.set()
    worker.move(MODEL, MemoryTier.TIER1, None)
    return worker


def aggregate_tokens_per_s(worker: Worker, streams: int, max_tokens: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(
            pool.map(lambda p: chat(worker, [{"role": "user", "content": p}], max_tokens), PROMPTS[:streams])
        )
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return tokens / (time.perf_counter() - started)


def next_turn_ms(worker: Worker) -> tuple[float, int]:
    """A conversation of more than 1,000 tokens, the model swapped to tier 2 and back by the
    next turn itself; that turn's latency and the prompt tokens it evaluated."""
    history = [
        {"role": "system", "content": "You are a patient storyteller. " + "Keep every detail consistent. " * 200},
        {"role": "user", "content": "Tell me about the dragon."},
    ]
    first = chat(worker, history, 8)
    assert first["usage"]["prompt_tokens"] >= 1000, first["usage"]
    history += [{"role": "assistant", "content": "It was old."}, {"role": "user", "content": "And then?"}]
    worker.move(MODEL, MemoryTier.TIER2, None)
    started = time.perf_counter()
    second = chat(worker, history, 1)
    return (time.perf_counter() - started) * 1000, second["usage"]["prompt_tokens"] - second["usage"]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    worker = worker_with(slots=3, kv_park=False)
    one = statistics.median(aggregate_tokens_per_s(worker, 1, args.tokens) for _ in range(args.runs))
    three = statistics.median(aggregate_tokens_per_s(worker, 3, args.tokens) for _ in range(args.runs))
    worker.shutdown()
    print(f"aggregate decode, {MODEL}, 3 slots, {args.tokens} tokens per stream, medians of {args.runs}:")
    print(f"  1 stream  {one:7.1f} tok/s\n  3 streams {three:7.1f} tok/s   ratio {three / one:.2f}x\n")

    rows = {}
    for park in (False, True):
        worker = worker_with(slots=1, kv_park=park)
        runs = [next_turn_ms(worker) for _ in range(args.runs)]
        worker.shutdown()
        rows[park] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    print("next turn after a swap (tier 1 -> tier 2 -> tier 1), conversation > 1,000 tokens:")
    for park, (ms, evaluated) in rows.items():
        print(f"  {'with' if park else 'without'} KV parking {ms:8.0f} ms, {evaluated:5d} prompt tokens evaluated")
    print(f"  ratio without / with: {rows[False][0] / rows[True][0]:.1f}x")


if __name__ == "__main__":
    main()
