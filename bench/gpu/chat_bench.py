"""Chat decode on the GPU: Hypnos's llama engine against llama.cpp's own `llama-server` on the
same GGUF, the same messages, greedy, the same number of tokens (the generated model never ends
an answer early), in one run.

Hypnos is measured twice: with the `gpu_layers` the planner gives a whole placement (what the
worker passes to the engine), and with every layer and the output head on the GPU (what
llama-server's `-ngl 999` does), so a gap from placement is told apart from a gap from serving.
Figures are the engines' own timings: Hypnos's ChatResult and llama-server's `timings`.

    python3 -m bench.gpu.chat_bench MODEL.gguf [--server PATH/llama-server] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def hypnos_runs(model: Path, gpu_layers: int, runs: int, max_tokens: int, context: int) -> dict[str, Any]:
    """Decode and TTFT figures of `runs` greedy chats on the project's LlamaEngine."""
    from hypnos_site.config import ModelConfig
    from inference.engines.base import ChatWork
    from inference.engines.llama import LlamaEngine

    config = ModelConfig(
        id="gpu-bench", modality="text_generation", engine="ggml_llama", weights_path=str(model), context_len=context
    )
    engine = LlamaEngine(config, model, os.cpu_count())
    phases = engine.load(context, gpu_layers)
    decode, ttft = [], []
    try:
        for i in range(runs + 1):  # the first is a warm-up
            work = ChatWork(messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, seed=1)
            result = engine.chat(work, threading.Event(), lambda *_: None)
            if i:
                timings = result.engine_timings()
                decode.append(timings["decode_tokens_per_s"])
                ttft.append(timings["ttft_ms"])
        tokens = result.completion_tokens
    finally:
        engine.cool()
    return {
        "gpu_layers": gpu_layers,
        "load_ms": round(phases.total_ms, 1),
        "completion_tokens": tokens,
        "decode_tokens_per_s": round(statistics.median(decode), 1),
        "ttft_ms": round(statistics.median(ttft), 1),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_runs(server: Path, model: Path, runs: int, max_tokens: int, context: int) -> dict[str, Any]:
    """The same chats through llama-server's /v1/chat/completions, every layer on the GPU."""
    port = free_port()
    libs = [str(server.parent)]
    try:
        import llama_cpp  # the wheel's libllama / libggml, which the cached llama-server links

        libs.append(str(Path(llama_cpp.__file__).parent / "lib"))
    except ImportError:
        pass
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]))
    cmd = [str(server), "-m", str(model), "-ngl", "999", "-c", str(context), "-np", "1"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "-t", str(os.cpu_count())]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        started = time.monotonic()
        wait_healthy(port, process)
        load_ms = (time.monotonic() - started) * 1000
        decode, ttft = [], []
        for i in range(runs + 1):
            # No prompt cache: every run prefills whole, as Hypnos's seeded runs do.
            body = {
                "messages": MESSAGES,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "seed": 1,
                "cache_prompt": False,
            }
            answer = post(port, "/v1/chat/completions", body)
            if i:
                timings = answer["timings"]
                decode.append(timings["predicted_per_second"])
                ttft.append(timings["prompt_ms"])
        return {
            "load_ms": round(load_ms, 1),
            "completion_tokens": answer["usage"]["completion_tokens"],
            "decode_tokens_per_s": round(statistics.median(decode), 1),
            "ttft_ms": round(statistics.median(ttft), 1),
        }
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_healthy(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"llama-server exited with {process.returncode}: {err[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"llama-server was not healthy within {timeout} s")


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--server", type=Path, help="llama-server built from the same llama.cpp")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from memory.planner import footprint_from_gguf

    n_layers = footprint_from_gguf(args.model).n_layers
    result: dict[str, Any] = {
        "hypnos_planned": hypnos_runs(args.model, n_layers, args.runs, args.max_tokens, args.context),
        "hypnos_all_on_gpu": hypnos_runs(args.model, n_layers + 1, args.runs, args.max_tokens, args.context),
    }
    if args.server is not None:
        server = server_runs(args.server, args.model, args.runs, args.max_tokens, args.context)
        result["llama_server"] = server
        for name in ("hypnos_planned", "hypnos_all_on_gpu"):
            result[f"{name}_vs_server_decode"] = round(
                result[name]["decode_tokens_per_s"] / server["decode_tokens_per_s"], 3
            )
    else:
        result["llama_server"] = "not run: no llama-server was built or cached in this run"
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
