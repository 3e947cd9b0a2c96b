"""Tier switch cost: a cold tier-3 -> tier-1 load against a tier-2 -> tier-1 promotion of the same
model, side by side, with raw llama-cpp-python loading the same file (page cache dropped) as the
baseline. Runs the worker in-process; on a machine with an NVIDIA GPU (NVML present) the same
moves are measured on CUDA and the NVML figures are printed with them.

    .venv/bin/python bench/tiers.py [--runs 5] [--model smollm2-135m] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")
os.environ.setdefault("HYPNOS_LOG_LEVEL", "WARNING")

import django  # noqa: E402

django.setup()

import llama_cpp  # noqa: E402
from django.conf import settings  # noqa: E402

from inference.engines.base import drop_page_cache  # noqa: E402
from inference.worker import Worker  # noqa: E402
from memory.tiers import MemoryTier  # noqa: E402

log = logging.getLogger("bench.tiers")


def raw_cold_load_ms(path: Path, context_len: int, threads: int | None) -> float:
    """llama-cpp-python's own load of the file with its page cache dropped first."""
    drop_page_cache(path)
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=context_len, n_threads=threads, verbose=False)
    elapsed = (time.perf_counter() - started) * 1000
    llm.close()
    return elapsed


def promotion_ms(worker: Worker, model: str, start: MemoryTier, context_len: int) -> dict[str, Any]:
    """Put the model in `start`, then promote it to tier 1; the load phases it reported."""
    worker.move(model, start, None)
    runtime = worker.models[model]
    before = runtime.loads
    started = time.perf_counter()
    worker.move(model, MemoryTier.TIER1, context_len)
    wall = (time.perf_counter() - started) * 1000
    assert runtime.loads == before + 1, "the promotion did not load the model"
    entry = worker.tiers.entries[model]
    return {"wall_ms": wall, "load_ms": entry.load_ms[start]}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", action="append", help="model id (repeatable); default: every configured model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    worker = Worker(settings.HYPNOS)
    worker._staged.set()  # no startup staging: every move below is the benchmark's own
    models = args.model or [m.id for m in settings.HYPNOS.models]
    threads = settings.HYPNOS.hardware.n_threads
    caps = worker.device.capabilities
    print(
        f"device: {caps.device_name} ({'simulated' if caps.simulated else caps.accelerator}), "
        f"{args.runs} runs per figure, medians\n"
    )
    rows = []
    for model in models:
        config = worker.resolve(model).config
        path = settings.HYPNOS.weights_file(config)
        context = config.context_len
        cold, warm, raw = [], [], []
        for _ in range(args.runs):
            cold.append(promotion_ms(worker, model, MemoryTier.TIER3, context)["wall_ms"])
            warm.append(promotion_ms(worker, model, MemoryTier.TIER2, context)["wall_ms"])
            worker.move(model, MemoryTier.TIER3, None)
            raw.append(raw_cold_load_ms(path, context, threads))
        row = {
            "model": model,
            "weights_bytes": path.stat().st_size,
            "context_len": context,
            "tier3_to_tier1_ms": median(cold),
            "tier2_to_tier1_ms": median(warm),
            "raw_cold_load_ms": median(raw),
        }
        if not caps.simulated:
            row["nvml_free_after_bytes"] = worker.device.real_vram()
        rows.append(row)
    worker.shutdown()

    print(
        f"{'model':<22}{'MB':>7}{'ctx':>6}{'raw cold':>11}{'3 -> 1':>10}{'2 -> 1':>10}"
        f"{'3->1 / 2->1':>13}{'3->1 / raw':>12}"
    )
    for r in rows:
        print(
            f"{r['model']:<22}{r['weights_bytes'] / 1e6:>7.0f}{r['context_len']:>6}{r['raw_cold_load_ms']:>9.0f}ms"
            f"{r['tier3_to_tier1_ms']:>8.0f}ms{r['tier2_to_tier1_ms']:>8.0f}ms"
            f"{r['tier3_to_tier1_ms'] / r['tier2_to_tier1_ms']:>12.1f}x"
            f"{r['tier3_to_tier1_ms'] / r['raw_cold_load_ms']:>11.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
