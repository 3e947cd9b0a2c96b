"""Issue 35's request bombs against a live server, one at a time, with the server's memory watched.

Starts the embedded server (``python -m hypnos_site.serve``, SQLite, in-process worker) with the
suite's models and the default ``[limits]``, then sends each bomb after a fresh baseline and
records the HTTP status (or WebSocket close code), the error code / param, the wall time, the
peak RSS growth of the server's process tree (sampled every 20 ms with psutil) over its RSS just
before the request, and whether ``/health`` still answers afterwards. The target: no request
grows the server by more than 512 MB. bench/README.md describes the method.

    .venv/bin/python bench/bombs.py --json /tmp/bombs.json
    .venv/bin/python bench/bombs.py --only schema_regex --only ws_big_message --cap-mb 3000
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import sys
import tempfile
import threading
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402
import psutil  # noqa: E402
from chat_stream import Proc, _fmt, _stop_on_sigterm, free_port, migrate, server_env  # noqa: E402
from server_cost import start_process, wait_ready  # noqa: E402

from hypnos_site.config import load_config  # noqa: E402
from tests.bomb_documents import docx_body_bytes, docx_parts, lying_docx, pdf_bytes, white_png, zip_bytes  # noqa: E402

log = logging.getLogger("bench.bombs")

MIB = 1 << 20
TARGET_GROWTH_MB = 512.0
SAMPLE_SECS = 0.02
CPU_SAMPLE_SECS = 0.1
# "Idle" for the abandoned-work bomb: the server's tree below this share of one core for
# IDLE_SAMPLES samples in a row (2 s: the work of a batch that starts later is seen).
IDLE_CPU_PCT = 10.0
IDLE_SAMPLES = 20
TARGET_ABANDON_SECS = 1.0
TARGET_SCHEMA_SECS = 10.0
ENTITY_DISCONNECT_SECS = 2.0
# A model's first request (its loading) and one entity text on a loaded 2-core machine can take
# tens of seconds: the warm-up and the abandoned-work bomb's one-text requests wait this long.
SLOW_REQUEST_SECS = 300.0
CHAT_MODEL = "smollm2-135m"
ENTITY_MODEL = "qwen2.5-coder-0.5b"
RATE = 24_000  # the Realtime API's pcm16 rate (inference/web/openai/realtime.py)


def write_config(directory: Path) -> Path:
    """The suite's models (tests/e2e/conftest.py's write_config, the parts the bombs use), no
    [limits]: the defaults are what is measured."""
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    media = {m.id: suite.weights_file(m) for m in suite.models if m.modality != "text_generation"}
    path = directory / "hypnos.toml"
    path.write_text(
        f"""\
[hardware]
pinned_ram_budget_bytes = 536870912
simulated_vram_bytes = 3221225472

[[models]]
id = "{CHAT_MODEL}"
modality = "text_generation"
engine = "ggml_llama"
weights_path = {json.dumps(str(suite.weights_file(suite.models[0])))}
context_len = 4096
initial_tier = "tier1_gpu_vram"

[[models]]
id = "{ENTITY_MODEL}"
modality = "text_generation"
engine = "ggml_llama"
weights_path = {json.dumps(str(suite.weights_file(suite.models[1])))}
context_len = 2048
additional_modalities = ["entity_extraction"]
initial_tier = "tier3_nvme_ssd"

[[models]]
id = "whisper-tiny.en"
modality = "speech_to_text"
engine = "ggml_whisper"
weights_path = {json.dumps(str(media["whisper-tiny.en"]))}
initial_tier = "tier3_nvme_ssd"

[[models]]
id = "docling"
modality = "document_conversion"
engine = "docling"
weights_path = {json.dumps(str(media["docling"]))}
initial_tier = "tier3_nvme_ssd"
"""
    )
    return path


# -- the server and its memory ------------------------------------------------------------------


def tree_rss(pid: int) -> int:
    """RSS in bytes of `pid` and every process below it (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


class Server:
    """The embedded server in a temporary directory, restarted when a bomb (or the cap) killed it."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.proc: Proc | None = None
        self.base_url = ""
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        data_dir = self.work_dir / f"server-{self.starts}"
        data_dir.mkdir()
        port = free_port()
        env = server_env("embedded", write_config(data_dir), data_dir, port)
        migrate(env)
        self.proc = start_process("serve", [sys.executable, "-m", "hypnos_site.serve"], env, data_dir)
        self.base_url = f"http://127.0.0.1:{port}"
        log.info("server ready after %.1f s", wait_ready(self.base_url + "/ready", [self.proc]))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.popen.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.alive():
            self.proc.popen.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def healthy(self) -> bool:
        try:
            return self.alive() and httpx.get(self.base_url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False


class RssWatch:
    """Samples the server tree's RSS every 20 ms in a thread; kills the server past `cap_bytes`."""

    def __init__(self, server: Server, cap_bytes: int | None):
        self.server = server
        self.cap_bytes = cap_bytes
        self.baseline = tree_rss(server.pid)
        self.peak = self.baseline
        self.killed_at_cap = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_SECS):
            rss = tree_rss(self.server.pid)
            self.peak = max(self.peak, rss)
            if self.cap_bytes is not None and rss > self.cap_bytes and not self.killed_at_cap:
                log.error("server tree at %d MB, above the cap: killing it", rss // MIB)
                self.killed_at_cap = True
                self.server.kill()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.baseline) / MIB


@dataclass
class Outcome:
    """What a bomb's request got back; `met` is the bomb's own target besides the memory one."""

    status: str
    code: str | None = None
    param: str | None = None
    met: bool = True
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    bomb: str
    status: str
    code: str | None
    param: str | None
    secs: float
    baseline_mb: float
    peak_growth_mb: float
    after_growth_mb: float
    healthy_after: bool
    killed_at_cap: bool
    target_met: bool
    notes: list[str]
    extra: dict[str, Any]


def http_outcome(response: httpx.Response) -> Outcome:
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    outcome = Outcome(str(response.status_code), error.get("code"), error.get("param"))
    if error.get("message"):
        outcome.notes.append(str(error["message"])[:200])
    return outcome


# -- the bombs ----------------------------------------------------------------------------------


class Bombs:
    """Each bomb: a function of the server that sends it and says what came back."""

    def __init__(self, server: Server, work_dir: Path, timeout: float):
        self.server = server
        self.work_dir = work_dir
        self.timeout = timeout
        self.payloads: dict[str, bytes] = {}

    def prepare(self) -> None:
        """The DOCXs, built before any request (building the 1.5 GiB one takes seconds)."""
        lying = lying_docx(self.work_dir / "lying.docx", 308, 1536 * MIB)
        self.payloads["docx_lying_sizes"] = lying.read_bytes()
        lying.unlink()
        self.payloads["docx_paragraphs"] = docx_body_bytes("<w:p/>" * 200_000)
        self.payloads["docx_picture"] = zip_bytes(docx_parts(white_png(5000, 5000)))

    def warm_up(self) -> None:
        """One small request per model, so that no bomb's growth counts a model's loading: an A4
        page without a text layer loads the PDF backend and the OCR's sessions."""
        started = time.monotonic()
        html = b"<html><body><p>Warm.</p></body></html>"
        for outcome in (
            self.convert("warm.html", html, "text/html"),
            self.convert("warm.pdf", pdf_bytes((595, 842)), "application/pdf"),
            http_outcome(self.chat()[0]),
            self.entities(["Mario Rossi works in Milan for Ferrari."]),
            self.transcribe(),
        ):
            if outcome.status != "200":
                raise RuntimeError(f"warm-up failed: {outcome}")
        log.info(
            "models warm after %.1f s; server tree %d MB", time.monotonic() - started, tree_rss(self.server.pid) // MIB
        )

    def entities(self, texts: list[str], timeout: float | None = None) -> Outcome:
        body = {"model": ENTITY_MODEL, "input": texts, "labels": ["person", "city", "company"]}
        return http_outcome(httpx.post(self.url + "/v1/entities", json=body, timeout=timeout or SLOW_REQUEST_SECS))

    def transcribe(self) -> Outcome:
        out = io.BytesIO()
        with wave.open(out, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(16_000)
            wav.writeframes(bytes(32_000))
        files = {"file": ("silence.wav", out.getvalue(), "audio/wav")}
        response = httpx.post(
            self.url + "/v1/audio/transcriptions", data={"model": "whisper-tiny.en"}, files=files, timeout=self.timeout
        )
        return http_outcome(response)

    @property
    def url(self) -> str:
        return self.server.base_url

    def convert(self, filename: str, data: bytes, mime: str, **fields: str) -> Outcome:
        files = {"file": (filename, data, mime)}
        response = httpx.post(
            self.url + "/v1/documents/convert",
            data={"model": "docling", **fields},
            files=files,
            timeout=self.timeout,
        )
        return http_outcome(response)

    def post_raw(self, path: str, body: bytes) -> Outcome:
        response = httpx.post(
            self.url + path, content=body, headers={"content-type": "application/json"}, timeout=self.timeout
        )
        return http_outcome(response)

    def chat(self, **extra: Any) -> tuple[httpx.Response, float]:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, **extra}
        started = time.monotonic()
        response = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=self.timeout)
        return response, time.monotonic() - started

    def blank_page(self, filename: str, media_box: tuple[int, int]) -> Outcome:
        """One blank page of `media_box` points, no text layer (OCR renders it)."""
        data = pdf_bytes(media_box)
        outcome = self.convert(filename, data, "application/pdf")
        outcome.extra["bytes"] = len(data)
        return outcome

    def pdf_huge_page(self) -> Outcome:
        return self.blank_page("huge.pdf", (14_400, 14_400))

    def pdf_thin_page(self) -> Outcome:
        return self.blank_page("thin.pdf", (200, 14_400))

    def pdf_flat_page(self) -> Outcome:
        return self.blank_page("flat.pdf", (14_400, 20))

    def json_empty_objects(self) -> Outcome:
        count = (8 * MIB - 50) // 3
        body = b'{"model":"' + CHAT_MODEL.encode() + b'","messages":[' + b"{}," * count + b"{}]}"
        return self.post_raw("/v1/chat/completions", body)

    def json_nested_arrays(self) -> Outcome:
        depth = 4 * MIB
        return self.post_raw("/v1/chat/completions", b"[" * depth + b"]" * depth)

    def docx_lying_sizes(self) -> Outcome:
        data = self.payloads["docx_lying_sizes"]
        mime = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
        outcome = self.convert("lying.docx", data, mime)
        outcome.extra["bytes"] = len(data)
        return outcome

    def docx_paragraphs(self) -> Outcome:
        mime = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
        return self.convert("paragraphs.docx", self.payloads["docx_paragraphs"], mime)

    def docx_picture(self) -> Outcome:
        data = self.payloads["docx_picture"]
        mime = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
        return self.convert("picture.docx", data, mime, return_pictures="true")

    def schema_regex(self) -> Outcome:
        schema = {
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": "^(a?){1000}$"}},
            "required": ["a"],
        }
        response, secs = self.chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
        outcome = http_outcome(response)
        plain, plain_secs = self.chat()
        outcome.extra.update(
            answer_secs=round(secs, 2), plain_status=plain.status_code, plain_secs=round(plain_secs, 2)
        )
        outcome.met = secs <= TARGET_SCHEMA_SECS and plain.status_code == 200
        outcome.notes.append(f"answered in {secs:.1f} s; plain chat after: {plain.status_code} in {plain_secs:.1f} s")
        return outcome

    def html_nested_divs(self) -> Outcome:
        html = "<html><body>" + "<div>" * 5000 + "deep" + "</div>" * 5000 + "</body></html>"
        return self.convert("deep.html", html.encode(), "text/html")

    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription&api_key=unused"

    def ws_big_message(self) -> Outcome:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        audio = base64.b64encode(bytes(1536 * 1024 * 3 // 4)).decode()  # 1.5 MiB of JSON
        message = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
        with connect(self.ws_url(), max_size=None, open_timeout=30) as ws:
            ws.recv(timeout=30)  # transcription_session.created
            try:
                ws.send(message)
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline:
                    ws.recv(timeout=deadline - time.monotonic())
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                return Outcome(f"close {code}", met=code == 1009)
            except TimeoutError:
                return Outcome("open", met=False, notes=["the socket stayed open"])
        return Outcome("?", met=False)

    def ws_many_turns(self) -> Outcome:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        turn = base64.b64encode(bytes(RATE * 2 * 5)).decode()  # 5 s of silence, 320 KB of base64
        errors: list[str] = []
        committed = 0
        with connect(self.ws_url(), max_size=None, open_timeout=30) as ws:
            ws.recv(timeout=30)
            ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": None}}))
            try:
                for _ in range(400):
                    ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": turn}))
                    ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                    # Read what came meanwhile, without waiting.
                    while True:
                        try:
                            event = json.loads(ws.recv(timeout=0))
                        except TimeoutError:
                            break
                        if event["type"] == "error":
                            errors.append(event["error"].get("code") or "?")
                        elif event["type"] == "input_audio_buffer.committed":
                            committed += 1
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        event = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
                    except TimeoutError:
                        break
                    if event["type"] == "error":
                        errors.append(event["error"].get("code") or "?")
                    elif event["type"] == "input_audio_buffer.committed":
                        committed += 1
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                return Outcome(f"close {code}", met=False, extra={"committed": committed, "errors": errors})
        full = errors.count("turn_queue_full")
        # The socket is closed here: the RSS after it is the watch's last sample (reported as after).
        time.sleep(1.0)
        return Outcome(
            "open",
            "turn_queue_full" if full else (errors[0] if errors else None),
            met=full > 0,
            notes=[f"{committed} turns committed, {full} refused with turn_queue_full"],
            extra={"committed": committed, "errors": sorted(set(errors))},
        )

    def entities_abandoned(self) -> Outcome:
        one = ["Mario Rossi works in Milan for Ferrari."]
        started = time.monotonic()
        self.entities(one)
        one_before_secs = time.monotonic() - started
        texts = [f"Person {i} works in Milan for Ferrari, says report {i}." for i in range(3000)]
        proc = psutil.Process(self.server.pid)
        procs = [proc, *proc.children(recursive=True)]
        for p in procs:
            p.cpu_percent(None)
        outcome = Outcome("disconnected")
        try:
            outcome = self.entities(texts, timeout=ENTITY_DISCONNECT_SECS)
            outcome.notes.append("answered before the client left")
        except httpx.TimeoutException:
            pass
        left = time.monotonic()
        idle_secs, peak_pct = self._secs_until_idle(procs, left)
        started = time.monotonic()
        after = self.entities(one)
        one_secs = time.monotonic() - started
        outcome.met = idle_secs is not None and idle_secs <= TARGET_ABANDON_SECS and after.status == "200"
        outcome.extra.update(
            idle_after_leaving_secs=idle_secs,
            peak_cpu_pct_after_leaving=peak_pct,
            one_text_before_secs=round(one_before_secs, 2),
            one_text_after_secs=round(one_secs, 2),
        )
        idle = "not within 30 s" if idle_secs is None else f"{idle_secs:.1f} s"
        outcome.notes.append(
            f"CPU idle {idle} after the client left (peak {peak_pct:.0f}% of a core meanwhile); one text: "
            f"{one_before_secs:.1f} s before, {after.status} in {one_secs:.1f} s right after"
        )
        return outcome

    def _secs_until_idle(self, procs: list[psutil.Process], since: float) -> tuple[float | None, float]:
        """Seconds from `since` to the start of IDLE_SAMPLES samples in a row under IDLE_CPU_PCT
        of one core (None: not within 30 s), and the busiest sample meanwhile."""
        quiet_from: float | None = None
        quiet, peak = 0, 0.0
        while time.monotonic() < since + 30:
            time.sleep(CPU_SAMPLE_SECS)
            at = time.monotonic()
            busy = 0.0
            for p in procs:
                try:
                    busy += p.cpu_percent(None)
                except psutil.Error:
                    pass
            peak = max(peak, busy)
            if busy < IDLE_CPU_PCT:
                quiet_from, quiet = (quiet_from or at - CPU_SAMPLE_SECS), quiet + 1
                if quiet >= IDLE_SAMPLES:
                    return round(max(quiet_from - since, 0.0), 2), peak
            else:
                quiet_from, quiet = None, 0
        return None, peak


BOMBS = (
    "pdf_huge_page",
    "pdf_thin_page",
    "pdf_flat_page",
    "json_empty_objects",
    "json_nested_arrays",
    "docx_lying_sizes",
    "docx_paragraphs",
    "docx_picture",
    "schema_regex",
    "html_nested_divs",
    "ws_big_message",
    "ws_many_turns",
    "entities_abandoned",
)


def run_bomb(name: str, bombs: Bombs, cap_bytes: int | None) -> Result:
    """One bomb after a fresh baseline, the server's tree watched meanwhile."""
    server, send = bombs.server, getattr(bombs, name)
    if not server.alive():
        log.warning("the server is down; starting it again before %s", name)
        server.start()
        bombs.warm_up()
    time.sleep(0.5)
    started = time.monotonic()
    with RssWatch(server, cap_bytes) as watch:
        try:
            outcome = send()
        except httpx.TimeoutException:
            outcome = Outcome("hang", met=False, notes=["no answer within the timeout"])
        except (httpx.HTTPError, OSError) as exc:
            outcome = Outcome("error", met=False, notes=[f"{type(exc).__name__}: {exc}"])
        secs = time.monotonic() - started
        time.sleep(0.3)
    after = tree_rss(server.pid)
    healthy = server.healthy()
    growth = watch.growth_mb
    met = outcome.met and healthy and not watch.killed_at_cap and growth <= TARGET_GROWTH_MB
    log.info("%s: %s %s, %.1f s, +%.0f MB, healthy %s", name, outcome.status, outcome.code, secs, growth, healthy)
    return Result(
        bomb=name,
        status=outcome.status,
        code=outcome.code,
        param=outcome.param,
        secs=round(secs, 2),
        baseline_mb=round(watch.baseline / MIB, 1),
        peak_growth_mb=round(growth, 1),
        after_growth_mb=round((after - watch.baseline) / MIB, 1),
        healthy_after=healthy,
        killed_at_cap=watch.killed_at_cap,
        target_met=met,
        notes=outcome.notes,
        extra=outcome.extra,
    )


def render(results: list[Result]) -> str:
    header = ["bomb", "status", "code / param", "seconds", "peak growth MB", "after MB", "health", "target met"]
    body = [
        [
            r.bomb,
            r.status + (" (killed at cap)" if r.killed_at_cap else ""),
            "/".join(x for x in (r.code, r.param) if x) or "-",
            _fmt(r.secs, 1),
            _fmt(r.peak_growth_mb, 0),
            _fmt(r.after_growth_mb, 0),
            "ok" if r.healthy_after else "DOWN",
            "yes" if r.target_met else "NO",
        ]
        for r in results
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *body]
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=BOMBS, help="send only this bomb (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a bomb may take (default 120)")
    parser.add_argument("--cap-mb", type=float, help="kill the server when its tree's RSS passes this many MB")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cap_bytes = int(args.cap_mb * MIB) if args.cap_mb else None
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hypnos-bombs-") as tmp:
        work_dir = Path(tmp)
        server = Server(work_dir)
        bombs = Bombs(server, work_dir, args.timeout)
        try:
            bombs.prepare()
            server.start()
            bombs.warm_up()
            for name in (b for b in BOMBS if b in (args.only or BOMBS)):
                results.append(run_bomb(name, bombs, cap_bytes))
        except BaseException:
            if server.proc is not None:
                log.error("server output (last lines):\n%s", server.proc.tail())
            raise
        finally:
            server.stop()
    print(f"issue 35 bombs, default [limits]; target: peak growth <= {TARGET_GROWTH_MB:g} MB, server answering after")
    print(render(results))
    for r in results:
        for note in r.notes:
            print(f"{r.bomb}: {note}")
    if args.json:
        document = {
            "benchmark": "bench/bombs.py",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"timeout_secs": args.timeout, "cap_mb": args.cap_mb, "target_growth_mb": TARGET_GROWTH_MB},
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(r.target_met for r in results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; the server this run started has been stopped")
        sys.exit(130)
