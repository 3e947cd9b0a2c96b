"""Interactive time to first token while a batch runs: the Batch API's promise (issue 33) that
bulk work does not come at the expense of interactive traffic.

One deployment (default embedded) serving SmolLM2-135M with 2 slots; three scenarios, one after
the other, each measuring `--runs` streamed interactive chats (TTFT, from the request to the
first chunk that carries text; the role chunk before it comes before any inference):

- ``idle``: nothing else runs;
- ``batch``: a Batch API batch of `--lines` chat requests to the same model is running (its
  lines carry x-hypnos-priority: background);
- ``client loop``: what people do without the Batch API, `--loop-clients` clients (default:
  as many as the model has slots) each sending the same requests one after another at the
  default (interactive) priority.

The table gives the median and p90 TTFT of each and the ratio of its median to idle's, and how
many of the bulk lines ended while the interactive chats were measured.

    .venv/bin/python bench/batches.py [--runs 20] [--lines 200] [--deployment embedded] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402

from bench.deployments import running_server  # noqa: E402
from hypnos_site.config import load_config  # noqa: E402

log = logging.getLogger("bench.batches")
SUITE_CONFIG = BASE_DIR / "tests" / "hypnos.test.toml"
MODEL = "smollm2-135m"
INTERACTIVE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
BULK_TOKENS = 48


def write_config(directory: Path, threads: int, slots: int) -> Path:
    suite = load_config({"HYPNOS_CONFIG": str(SUITE_CONFIG)})
    block = next(b for b in tomllib.loads(SUITE_CONFIG.read_text())["models"] if b["id"] == MODEL)
    weights = suite.weights_file(next(m for m in suite.models if m.id == MODEL)).resolve()
    fields = {k: v for k, v in block.items() if k not in ("package", "package_parts", "sha256")}
    fields.update(weights_path=str(weights), initial_tier="tier1_gpu_vram", slots=slots)
    lines = [f"[hardware]\nn_threads = {threads}\n", "[[models]]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in fields.items() if not isinstance(value, dict)]
    path = directory / "hypnos.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def bulk_request(i: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a short paragraph about the number {i}."}],
        "max_tokens": BULK_TOKENS,
        "temperature": 0,
    }


# --fresh: every interactive chat a new conversation, its ~300-token system prompt opened by a
# number of its own, so no slot holds its prefix and the whole prompt is evaluated (the usual
# case of a new chat) rather than the one token of a repeated question.
SYSTEM = " ".join(["You are a careful assistant who answers in one short sentence."] * 25)
fresh_prompts = False
asked = 0


def interactive_messages() -> list[dict[str, str]]:
    global asked
    asked += 1
    if not fresh_prompts:
        return INTERACTIVE
    return [{"role": "system", "content": f"Conversation {asked}. {SYSTEM}"}, *INTERACTIVE]


def ttft_ms(client: httpx.Client) -> float:
    body = {"model": MODEL, "messages": interactive_messages(), "max_tokens": 16, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            # The first chunk carrying text: the role chunk before it (content "") comes before
            # any inference.
            if line.startswith("data: {") and json.loads(line[len("data: ") :])["choices"][0]["delta"].get("content"):
                first = (time.perf_counter() - started) * 1000
                for _ in lines:  # the rest of the answer, as a client reads it
                    pass
                return first
    raise RuntimeError("the stream ended without content")


def measure(client: httpx.Client, runs: int) -> list[float]:
    ttft_ms(client)  # warm-up, not counted
    samples = []
    for _ in range(runs):
        samples.append(ttft_ms(client))
        time.sleep(0.2)  # a person's pace, not a flood
    return samples


def with_batch(client: httpx.Client, runs: int, lines: int) -> tuple[list[float], int]:
    content = "".join(
        json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": bulk_request(i)})
        + "\n"
        for i in range(lines)
    )
    uploaded = client.post("/v1/files", files={"file": ("bulk.jsonl", content)}, data={"purpose": "batch"}).json()
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
        time.sleep(0.1)
    before = client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"]
    samples = measure(client, runs)
    after = client.get(f"/v1/batches/{batch['id']}").json()
    client.post(f"/v1/batches/{batch['id']}/cancel")
    if after["status"] not in ("in_progress", "cancelling"):
        log.warning("the batch ended (%s) before the measurement did: use more --lines", after["status"])
    while client.get(f"/v1/batches/{batch['id']}").json()["status"] not in ("completed", "cancelled", "failed"):
        time.sleep(0.2)
    return samples, after["request_counts"]["completed"] - before


def with_client_loop(client: httpx.Client, runs: int, base_url: str, clients: int) -> tuple[list[float], int]:
    stop = threading.Event()
    done = [0]
    lock = threading.Lock()

    def loop(offset: int) -> None:
        with httpx.Client(base_url=base_url, timeout=300) as own:
            i = offset
            while not stop.is_set():
                own.post("/v1/chat/completions", json=bulk_request(i)).raise_for_status()
                with lock:
                    done[0] += 1
                i += clients

    threads = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    while done[0] < 1:
        time.sleep(0.1)
    before = done[0]
    samples = measure(client, runs)
    ended = done[0] - before
    stop.set()
    for thread in threads:
        thread.join(300)
    return samples, ended


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1] if len(samples) >= 2 else samples[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--loop-clients", type=int, help="parallel clients of the client loop (default: --slots)")
    parser.add_argument("--deployment", choices=("embedded", "distributed"), default="embedded")
    parser.add_argument("--fresh", action="store_true", help="each interactive chat a new ~300-token conversation")
    args = parser.parse_args()
    global fresh_prompts
    fresh_prompts = args.fresh
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-batches-") as tmp:
        work_dir = Path(tmp)
        config = write_config(work_dir, args.threads, args.slots)
        with running_server(args.deployment, config, work_dir) as server:
            with httpx.Client(base_url=server.base_url, timeout=300) as client:
                idle = measure(client, args.runs)
                batch, batch_lines = with_batch(client, args.runs, args.lines)
                loop, loop_lines = with_client_loop(client, args.runs, server.base_url, args.loop_clients or args.slots)
    base = statistics.median(idle)
    prompts = "new ~300-token conversations" if args.fresh else "one repeated question (its prefix cached)"
    print(f"\ninteractive TTFT, {args.deployment}, {MODEL}, {args.slots} slots, {args.runs} runs each, {prompts}")
    print(f"{'scenario':<14}{'median ms':>10}{'p90 ms':>10}{'x idle':>8}{'bulk lines':>12}")
    for name, samples, lines in (("idle", idle, 0), ("batch", batch, batch_lines), ("client loop", loop, loop_lines)):
        median = statistics.median(samples)
        print(f"{name:<14}{median:>10.1f}{p90(samples):>10.1f}{median / base:>8.2f}{lines:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
