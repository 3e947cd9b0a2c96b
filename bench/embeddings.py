"""Embedding throughput (texts per second) through the embedded Hypnos server over HTTP, against
raw llama-cpp-python on the same GGUF and the same texts, side by side, as ratios.

Two raw baselines: one evaluation per text (what the server does, so that a batch gives exactly
the vectors of single calls) and llama-cpp-python's own batched `embed(list)`.

    .venv/bin/python bench/embeddings.py [--runs 5] [--batch 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.audio import ROOT, EmbeddedServer, median, timed  # noqa: E402
from hypnos_site.config import load_config  # noqa: E402

MODEL = "all-minilm-l6-v2"
WORDS = (
    "the quick brown fox jumps over a lazy dog while the weather stays nice and the report reaches "
    "the office before noon next week"
).split()


def texts(n: int) -> list[str]:
    """n different sentences of 8 to 20 words."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 13)) + "." for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--batch", type=int, default=64, help="texts per request")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = load_config({"HYPNOS_CONFIG": str(ROOT / "tests" / "hypnos.test.toml")})
    model = next(m for m in config.models if m.id == MODEL)
    batch = texts(args.batch)
    runs: dict[str, list[float]] = {"raw one by one": [], "raw batched": [], "server float": [], "server base64": []}
    with EmbeddedServer(config, [MODEL], args.threads) as server, httpx.Client(timeout=300) as http:

        def embed(encoding: str) -> None:
            response = http.post(
                f"{server.base_url}/v1/embeddings", json={"model": MODEL, "input": batch, "encoding_format": encoding}
            )
            response.raise_for_status()
            assert len(response.json()["data"]) == len(batch)

        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=str(config.weights_file(model)),
            embedding=True,
            n_ctx=model.context_len,
            n_batch=model.context_len,
            n_ubatch=model.context_len,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )
        targets = {
            "raw one by one": lambda: [llm.embed(t, normalize=True) for t in batch],
            "raw batched": lambda: llm.embed(batch, normalize=True),
            "server float": lambda: embed("float"),
            "server base64": lambda: embed("base64"),
        }
        for run in targets.values():
            run()  # warm-up (the server's loads the model)
        for _ in range(args.runs):
            for name, run in targets.items():
                secs, _ = timed(run)
                runs[name].append(len(batch) / secs)
    base, base_best = median(runs["raw one by one"]), max(runs["raw one by one"])
    print(
        f"{MODEL} (GGUF F16 via llama.cpp): texts/s over {args.runs} runs of {len(batch)} texts after a "
        f"warm-up, {args.threads} threads; median and best (the best is the least disturbed by other load)"
    )
    print(f"{'target':<15}| {'median':>8} | {'best':>8} | {'median ratio':>12} | {'best ratio':>10}")
    print("-" * 15 + "+" + "-" * 10 + "+" + "-" * 10 + "+" + "-" * 14 + "+" + "-" * 11)
    summary = {}
    for name, values in runs.items():
        rate, best = median(values), max(values)
        summary[name] = {
            "texts_per_s": rate,
            "best_texts_per_s": best,
            "ratio": rate / base,
            "best_ratio": best / base_best,
        }
        print(f"{name:<15}| {rate:8.1f} | {best:8.1f} | {rate / base:12.2f} | {best / base_best:10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
