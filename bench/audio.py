"""Speech and transcription speed: the real-time factor (processing seconds per audio second)
through the embedded Hypnos server over HTTP, against the raw engines in this process on the
same inputs, side by side, as ratios.

- speech: POST /v1/audio/speech (wav) with Piper, against `PiperVoice.synthesize` on the same
  phrases; RTF = wall time / seconds of audio produced;
- transcription: POST /v1/audio/transcriptions (multipart wav) with Whisper tiny.en, against
  `WhisperModel.transcribe` with the server's settings; RTF = wall time / seconds of audio;
- voice turns (transcription, chat on SmolLM2, speech of the answer) declared as workflows with
  `x-hypnos-next-model` on each step: the server's end-to-end p50 / p95 / p99 of them.

    .venv/bin/python bench/audio.py [--runs 5] [--json out.json]

`bench/embeddings.py` uses `EmbeddedServer` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypnos_site.config import HypnosConfig, ModelConfig, load_config  # noqa: E402

TEXT = (
    "Good morning. The weather is nice today. Please send the report to the office before noon. "
    "We will meet again next week."
)
TTS, STT, CHAT = "piper-joe", "whisper-tiny.en", "smollm2-135m"
TURN_TOKENS = 32


class EmbeddedServer:
    """`python -m hypnos_site.serve` (embedded deployment) with the given models, on a free
    port, with its own data dir; models start in tier 3 and are loaded by the warm-up."""

    def __init__(self, config: HypnosConfig, model_ids: list[str], threads: int | None):
        self.dir = Path(tempfile.mkdtemp(prefix="hypnos-bench-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        blocks = [_block(config, m) for m in config.models if m.id in model_ids]
        hardware = f"[hardware]\nn_threads = {threads}\n" if threads else ""
        (self.dir / "hypnos.toml").write_text(hardware + "\n".join(blocks))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
        self.env.update(
            HYPNOS_CONFIG=str(self.dir / "hypnos.toml"),
            HYPNOS_DATA_DIR=str(self.dir),
            HYPNOS_PORT=str(self.port),
            DJANGO_SETTINGS_MODULE="hypnos_site.settings",
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EmbeddedServer:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v0"],
            cwd=ROOT,
            env=self.env,
            check=True,
            capture_output=True,
        )
        log = (self.dir / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hypnos_site.serve"], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{(self.dir / 'serve.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server was not ready in 120 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def _block(config: HypnosConfig, model: ModelConfig) -> str:
    return (
        f'[[models]]\nid = "{model.id}"\nmodality = "{model.modality}"\nengine = "{model.engine}"\n'
        f'weights_path = "{config.weights_file(model)}"\ncontext_len = {model.context_len}\n'
        'initial_tier = "tier3_nvme_ssd"\n'
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def raw_speech(config: HypnosConfig, threads: int | None) -> Callable[[], float]:
    """Piper on the same phrases as the server (its phrase chunking), no resampling or encoding:
    returns a callable that synthesizes TEXT and gives the seconds of audio made."""
    import numpy as np
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    from inference.engines.audio import phrases

    folder = config.weights_file(next(m for m in config.models if m.id == TTS))
    graph = next(folder.glob("*.onnx"))
    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    voice = PiperVoice(
        config=PiperConfig.from_dict(json.loads(graph.with_name(graph.name + ".json").read_text())),
        session=onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"]),
    )

    def run() -> float:
        samples = sum(len(np.concatenate([c.audio_float_array for c in voice.synthesize(p)])) for p in phrases(TEXT))
        return samples / voice.config.sample_rate

    return run


def raw_transcription(config: HypnosConfig, threads: int | None, wav: bytes) -> Callable[[], float]:
    """faster-whisper with the server's settings on the same clip; gives the clip's seconds."""
    import io

    from faster_whisper import WhisperModel
    from faster_whisper.audio import decode_audio

    from inference.engines.whisper import FALLBACK_TEMPERATURES

    folder = config.weights_file(next(m for m in config.models if m.id == STT))
    model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=threads or 0)

    def run() -> float:
        samples = decode_audio(io.BytesIO(wav))
        segments, _ = model.transcribe(
            samples, language="en", beam_size=5, temperature=FALLBACK_TEMPERATURES, condition_on_previous_text=False
        )
        list(segments)
        return len(samples) / 16000

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--turns", type=int, default=10, help="voice turns for the workflow percentiles")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = load_config({"HYPNOS_CONFIG": str(ROOT / "tests" / "hypnos.test.toml")})
    figures: dict[str, dict[str, list[float]]] = {
        "speech": {"server": [], "raw": [], "engine": []},
        "transcription": {"server": [], "raw": [], "engine": []},
    }
    with EmbeddedServer(config, [CHAT, TTS, STT], args.threads) as server, httpx.Client(timeout=300) as http:

        def speak() -> httpx.Response:
            response = http.post(
                f"{server.base_url}/v1/audio/speech", json={"model": TTS, "input": TEXT, "response_format": "wav"}
            )
            response.raise_for_status()
            return response

        def transcribe(wav: bytes) -> httpx.Response:
            response = http.post(
                f"{server.base_url}/v1/audio/transcriptions",
                data={"model": STT},
                files={"file": ("clip.wav", wav, "audio/wav")},
            )
            response.raise_for_status()
            return response

        wav = speak().content  # warm-up: loads the voice; the clip every transcription uses
        transcribe(wav)  # warm-up: loads Whisper
        raw_tts, raw_stt = raw_speech(config, args.threads), raw_transcription(config, args.threads, wav)
        raw_tts(), raw_stt()  # warm-ups
        for _ in range(args.runs):
            secs, response = timed(speak)
            audio_secs = float(response.headers["x-hypnos-audio-secs"])
            figures["speech"]["server"].append(secs / audio_secs)
            figures["speech"]["engine"].append(float(response.headers["x-hypnos-rtf"]))
            secs, audio_secs = timed(raw_tts)
            figures["speech"]["raw"].append(secs / audio_secs)
            secs, response = timed(lambda: transcribe(wav))
            body = response.json()
            figures["transcription"]["server"].append(secs / body["duration_secs"])
            figures["transcription"]["engine"].append(body["hypnos_telemetry"]["engine"]["rtf"])
            secs, audio_secs = timed(raw_stt)
            figures["transcription"]["raw"].append(secs / audio_secs)
        turns = voice_turns(http, server.base_url, wav, args.turns)
    print(
        f"RTF (processing seconds per audio second, lower is faster) over {args.runs} runs after a warm-up, "
        f"{args.threads} threads; clip {len(wav) / 48000:.2f} s; median and best (the least disturbed run)"
    )
    print(
        f"{'task':<14}| {'raw RTF':>8} | {'server RTF':>10} | {'engine RTF':>10} | {'server / raw':>12} "
        f"| {'best raw':>8} | {'best server':>11} | {'best ratio':>10}"
    )
    print(
        "-" * 14
        + "+"
        + "-" * 10
        + "+"
        + "-" * 12
        + "+"
        + "-" * 12
        + "+"
        + "-" * 14
        + "+"
        + "-" * 10
        + "+"
        + "-" * 13
        + "+"
        + "-" * 11
    )
    summary = {}
    for task, runs in figures.items():
        raw, server, engine = median(runs["raw"]), median(runs["server"]), median(runs["engine"])
        best_raw, best_server = min(runs["raw"]), min(runs["server"])
        summary[task] = {
            "raw_rtf": raw,
            "server_rtf": server,
            "server_engine_rtf": engine,
            "ratio": server / raw,
            "best_raw_rtf": best_raw,
            "best_server_rtf": best_server,
            "best_ratio": best_server / best_raw,
        }
        print(
            f"{task:<14}| {raw:8.3f} | {server:10.3f} | {engine:10.3f} | {server / raw:12.2f} "
            f"| {best_raw:8.3f} | {best_server:11.3f} | {best_server / best_raw:10.2f}"
        )
    print(
        f"\nvoice turn (transcription -> chat, {TURN_TOKENS} tokens -> speech), {args.turns} turns: "
        f"end to end p50 {turns['p50_ms']} ms, p95 {turns['p95_ms']} ms, p99 {turns['p99_ms']} ms "
        "(latency.workflows.voice of /v1/memory/status: histogram bucket upper bounds)"
    )
    if args.json:
        args.json.write_text(json.dumps({"runs": figures, "summary": summary, "voice_turn": turns}, indent=2))


def voice_turns(http: httpx.Client, base_url: str, wav: bytes, count: int) -> dict[str, Any]:
    """`count` voice turns declared as workflows, each step naming the next model; the server's
    own end-to-end percentiles of them."""
    for turn in range(count):
        flow = {"x-hypnos-workflow": f"voice/bench-{turn}"}
        heard = http.post(
            f"{base_url}/v1/audio/transcriptions",
            data={"model": STT},
            files={"file": ("turn.wav", wav, "audio/wav")},
            headers={**flow, "x-hypnos-next-model": CHAT},
        )
        heard.raise_for_status()
        answer = http.post(
            f"{base_url}/v1/chat/completions",
            headers={**flow, "x-hypnos-next-model": TTS},
            json={
                "model": CHAT,
                "max_tokens": TURN_TOKENS,
                "messages": [{"role": "user", "content": heard.json()["text"]}],
            },
        )
        answer.raise_for_status()
        reply = answer.json()["choices"][0]["message"]["content"] or "Okay."
        spoken = http.post(
            f"{base_url}/v1/audio/speech",
            headers={**flow, "x-hypnos-workflow-end": "true"},
            json={"model": TTS, "input": reply},
        )
        spoken.raise_for_status()
    return http.get(f"{base_url}/v1/memory/status").json()["latency"]["workflows"]["voice"]


if __name__ == "__main__":
    main()
