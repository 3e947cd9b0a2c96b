"""Image benchmark: images/s of the image generator and megapixels/s of the upscaler through
Hypnos (embedded and distributed) against the engine called directly on the same inputs, in one
run (spec §11, compat.md's POST /v1/images/upscale).

- ``engine``: the server's engine class constructed and loaded in this process, as the worker
  does (``OnnxImageEngine`` for ``dcgan-faces``, ``DiffusionEngine`` for a random-weight
  FLUX.2 klein-shaped model built by tests/diffusion_model.py (plumbing: its pictures are
  noise), ``NcnnUpscaleEngine`` for ``realesrgan-x4``), called with ``generate_image`` /
  ``upscale_image``; every pass is timed twice: the engine calls alone (``engine``), and the
  whole pass with the PNG work the worker does on the pixels, Pillow's encoder as
  inference/worker/images.py's ``_write`` uses it, and for an upscale the decoding of the input
  PNG (``engine+png``: the baseline of the ratios);
- ``embedded`` / ``distributed``: ``POST /v1/images/generations`` (the DCGAN at n=1 and n=4
  per request, 64x64; the diffusion model at 256x256, one step; fixed seeds) and
  ``POST /v1/images/upscale`` (a built picture of shapes and text, 128x128 and 512x512,
  factors 2 and 4), wall time of each HTTP request; ``distributed`` is daphne + ``manage.py
  runinference`` + a Celery worker over Redis, on PostgreSQL by default.

Both deployments run for the whole benchmark next to the engines loaded here; one target works
at a time. Each case gets one warm-up pass per target, then ``--runs`` measured passes,
interleaved round by round (the machine is shared, and its load drifts). Every PNG a server
returns must be byte for byte the engine's PNG of the same seed or picture. The table shows
medians and the ratios to the engine; a second table says where a request's time goes, from the
job rows' timestamps. bench/README.md describes the method.

    .venv/bin/python bench/images.py --runs 3
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import logging
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from bench.chat_stream import (  # noqa: E402
    CpuMeter,
    _stop_on_sigterm,
    wait_until_quiet,
)
from bench.deployments import Deployment, running_server  # noqa: E402
from bench.documents import own_pids  # noqa: E402
from hypnos_site.config import HypnosConfig, ImageConfig, ModelConfig, load_config  # noqa: E402

log = logging.getLogger("bench.images")

TARGETS = ("engine", "embedded", "distributed")
SERVERS = ("embedded", "distributed")
GENERATOR_ID = "dcgan-faces"
UPSCALER_ID = "realesrgan-x4"
# stable-diffusion.cpp on tests/diffusion_model.py's random-weight FLUX.2 klein-shaped model
# (plumbing, not a trained model), at the smallest size the worker allows and one step.
DIFFUSION_ID = "tiny-flux2-klein"
DIFFUSION_SIZE = 256
DIFFUSION_STEPS = 1
DIFFUSION_CFG_SCALE = 1.0
SUITE_CONFIG = BASE_DIR / "tests" / "hypnos.test.toml"
# The target: a server keeps at least this share of the engine's images/s or MP/s.
TARGET_RATIO = 0.9
REQUEST_TIMEOUT_SECS = 600.0
PROMPT = "a portrait photo of a smiling face"
BASE_SEED = 1234
GENERATOR_SIZE = 64
# The worker's clamps of a request's steps and cfg_scale (inference/worker/images.py); the DCGAN
# ignores both, a diffusion model would not.
MIN_STEPS, MAX_STEPS, MAX_CFG_SCALE = 1, 100, 30.0


@dataclass(frozen=True)
class Case:
    """One workload: `requests` requests per pass, each of `n` images `side` px square from a
    generator (`steps` and `cfg_scale` asked, or left to the model), or one upscale of the
    built `side` px picture by `factor`."""

    name: str
    op: str
    model: str
    requests: int
    side: int
    n: int = 1
    factor: int = 0
    steps: int | None = None
    cfg_scale: float | None = None

    @property
    def unit(self) -> str:
        return "images/s" if self.op == "generate" else "MP/s"

    @property
    def work_per_pass(self) -> float:
        """Images made (generate) or output megapixels (upscale, as the worker's
        megapixels_per_s counts them) in one pass."""
        if self.op == "generate":
            return float(self.requests * self.n)
        return self.requests * (self.side * self.factor) ** 2 / 1e6

    def seeds(self, request: int) -> list[int]:
        """The seeds of one request's images: the request's seed plus the image's index (spec
        §11), so the images of a pass are BASE_SEED, BASE_SEED + 1, ... whatever n is."""
        return [BASE_SEED + request * self.n + index for index in range(self.n)]


def build_cases(images: int, quick: bool, diffusion: bool) -> list[Case]:
    """The DCGAN at n=1 and n=4 with `images` images a pass; the diffusion model, one image a
    pass (seconds each); then the upscaler: the 128 px picture twice a pass (a pass of one
    would last a few hundred ms), the 512 px one once."""
    cases = [
        Case("dcgan n=1", "generate", GENERATOR_ID, requests=images, side=GENERATOR_SIZE),
        Case("dcgan n=4", "generate", GENERATOR_ID, requests=images // 4, side=GENERATOR_SIZE, n=4),
    ]
    if diffusion:
        cases.append(
            Case(
                "diffusion n=1",
                "generate",
                DIFFUSION_ID,
                requests=1,
                side=DIFFUSION_SIZE,
                steps=DIFFUSION_STEPS,
                cfg_scale=DIFFUSION_CFG_SCALE,
            )
        )
    for side, requests in ((128, 2), (512, 1)):
        if quick and side > 128:
            continue
        for factor in (2, 4):
            cases.append(Case(f"upscale {side} x{factor}", "upscale", UPSCALER_ID, requests, side, factor=factor))
    return cases


@dataclass
class Request:
    """One request (or, for the engine, one request's worth of calls): the client's wall time
    and, from a server, its telemetry and its job row's timestamps."""

    secs: float
    sent_at: float = 0.0
    received_at: float = 0.0
    request_id: str | None = None
    worker_ms: float | None = None
    queue_ms: float | None = None
    tier_switch_ms: float | None = None
    before_ms: float | None = None
    dispatch_ms: float | None = None
    job_ms: float | None = None
    after_ms: float | None = None


@dataclass
class Sample:
    """One pass of a case through a target: its wall time, the engine calls' share of it
    (engine only), the requests, and the sha256 of every PNG in order."""

    secs: float
    work: float
    engine_secs: float | None = None
    requests: list[Request] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    idle_before_pct: float | None = None
    foreign_cpu_pct: float | None = None
    disturbed: bool = False

    @property
    def rate(self) -> float:
        return self.work / self.secs

    @property
    def engine_rate(self) -> float | None:
        return None if self.engine_secs is None else self.work / self.engine_secs


@dataclass
class Series:
    """Every pass of one case through one target, and their medians."""

    case: str
    target: str
    warmup: Sample | None = None
    runs: list[Sample] = field(default_factory=list)
    discarded: list[Sample] = field(default_factory=list)
    # The rounds the figures come from (count_quiet_rounds).
    counted_rounds: list[int] = field(default_factory=list)

    @property
    def counted(self) -> list[Sample]:
        return [self.runs[i] for i in self.counted_rounds if i < len(self.runs)]

    def median(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.counted if getattr(s, name) is not None]
        return statistics.median(values) if values else None

    def request_median(self, name: str) -> float | None:
        values = [getattr(r, name) for s in self.counted for r in s.requests if getattr(r, name) is not None]
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class Settings:
    runs: int
    threads: int
    images: int
    quick: bool
    wait_idle_secs: float
    max_foreign_cpu_pct: float
    redo: int
    database: str


# One pass of a case: the sample, and the PNGs themselves (kept for the byte check, not written).
Pass = Callable[[Case], tuple[Sample, list[bytes]]]


# -- inputs --------------------------------------------------------------------------------------


def test_picture(side: int) -> bytes:
    """A PNG of flat shapes, edges and text (what an upscaler is for; noise would be neither
    realistic nor kind to PNG), drawn in proportion to `side`."""
    image = Image.new("RGB", (side, side))
    draw = ImageDraw.Draw(image)
    for y in range(side):  # a sky from blue to pale orange
        t = y / side
        draw.line([(0, y), (side, y)], fill=(int(60 + 170 * t), int(110 + 80 * t), int(200 - 90 * t)))
    s = side / 128
    draw.ellipse([88 * s, 10 * s, 116 * s, 38 * s], fill=(250, 220, 90), outline=(200, 120, 40), width=max(1, int(s)))
    draw.polygon([(0, 96 * s), (40 * s, 60 * s), (80 * s, 96 * s)], fill=(70, 110, 70))
    draw.rectangle([0, 96 * s, side, side], fill=(90, 150, 70))
    draw.rectangle([52 * s, 70 * s, 96 * s, 104 * s], fill=(180, 60, 50), outline=(40, 20, 20), width=max(1, int(s)))
    draw.polygon([(48 * s, 72 * s), (74 * s, 50 * s), (100 * s, 72 * s)], fill=(90, 40, 30))
    draw.rectangle([68 * s, 86 * s, 80 * s, 104 * s], fill=(60, 40, 30))
    for x in range(0, side, max(2, int(8 * s))):  # a fence of thin lines
        draw.line([(x, 108 * s), (x, 118 * s)], fill=(240, 240, 230), width=max(1, int(s)))
    draw.line([(0, 112 * s), (side, 112 * s)], fill=(240, 240, 230), width=max(1, int(s)))
    font = ImageFont.load_default(size=max(8, int(12 * s)))
    draw.text((6 * s, 8 * s), "Hypnos 4x", fill=(255, 255, 255), font=font, stroke_width=1, stroke_fill=(0, 0, 0))
    draw.text((6 * s, 118 * s), "abc 123", fill=(20, 20, 60), font=ImageFont.load_default(size=max(6, int(8 * s))))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def encode_png(pixels: np.ndarray) -> bytes:
    """The worker's PNG of an image (inference/worker/images.py `_write`), into memory."""
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    """An input PNG as the worker decodes a reference (`_decode`): RGB uint8 [H, W, 3]."""
    with Image.open(io.BytesIO(data)) as opened:
        return np.asarray(opened.convert("RGB"), dtype=np.uint8)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the engines, called directly ----------------------------------------------------------------


class DirectEngines:
    """The generator and the upscaler loaded in this process as the worker loads them (the
    same model blocks and threads), and one pass of a case on them."""

    def __init__(self, config: HypnosConfig, model_ids: list[str], pictures: dict[int, bytes]):
        from inference.engines.base import engine_class

        self.config = config
        self.pictures = pictures
        self.engines: dict[str, Any] = {}
        for model_id in model_ids:
            model = _model(config, model_id)
            # As the worker builds an engine (inference/worker/tier_moves.py `engine()`).
            engine = engine_class(model.engine, model.modality)(
                model, config.weights_file(model), config.hardware.n_threads, aux=config.aux_file(model)
            )
            with _c_stdout_to_stderr():
                phases = engine.load(model.context_len, 0)
            log.info("%s engine loaded in %.0f ms", model_id, phases.total_ms)
            self.engines[model_id] = engine

    def close(self) -> None:
        for engine in self.engines.values():
            engine.cool()

    def run(self, case: Case) -> tuple[Sample, list[bytes]]:
        """One pass: the engine calls timed on their own, and the pass as a whole."""
        engine = self.engines[case.model]
        cancel = threading.Event()
        pngs: list[bytes] = []
        requests: list[Request] = []
        engine_secs = 0.0
        started = time.perf_counter()
        for request in range(case.requests):
            request_started = time.perf_counter()
            if case.op == "generate":
                for seed in case.seeds(request):
                    spec = self._spec(case, engine, seed)
                    called = time.perf_counter()
                    pixels = engine.generate_image(spec, cancel)
                    engine_secs += time.perf_counter() - called
                    pngs.append(encode_png(pixels))
            else:
                reference = decode_png(self.pictures[case.side])
                called = time.perf_counter()
                pixels = engine.upscale_image(reference, case.factor, cancel)
                engine_secs += time.perf_counter() - called
                pngs.append(encode_png(pixels))
            requests.append(Request(secs=time.perf_counter() - request_started))
        secs = time.perf_counter() - started
        sample = Sample(secs=secs, work=case.work_per_pass, engine_secs=engine_secs, requests=requests)
        sample.digests = [_digest(png) for png in pngs]
        return sample, pngs

    def _spec(self, case: Case, engine: Any, seed: int) -> Any:
        """The ImageSpec the worker builds for the case's request (inference/worker/images.py
        `_plan`: steps and cfg_scale from the request or [models.image], clamped; none for an
        unconditional generator)."""
        from inference.engines.base import ImageSpec

        image = _model(self.config, case.model).image or ImageConfig()
        steps: int | None = min(max(case.steps if case.steps is not None else image.steps, MIN_STEPS), MAX_STEPS)
        cfg: float | None = min(max(image.cfg_scale if case.cfg_scale is None else case.cfg_scale, 0.0), MAX_CFG_SCALE)
        if "ignores_prompt" in engine.capabilities():
            steps = cfg = None
        return ImageSpec(
            prompt=PROMPT,
            negative_prompt="",
            width=case.side,
            height=case.side,
            steps=steps,
            cfg_scale=cfg,
            seed=seed,
            references=[],
            strength=image.strength,
        )


@contextmanager
def _c_stdout_to_stderr() -> Iterator[None]:
    """stable-diffusion.cpp writes blank lines to file descriptor 1 while it loads; the table
    is on stdout, so they go to stderr."""
    import ctypes

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def _model(config: HypnosConfig, model_id: str) -> ModelConfig:
    return next(m for m in config.models if m.id == model_id)


# -- the Hypnos server ---------------------------------------------------------------------------


def write_config(directory: Path, threads: int, diffusion: Path | None) -> Path:
    """The suite's generator and upscaler blocks (weights by absolute path), the diffusion
    model's block on the folder it was built in, all in tier 1 from the start, and the
    benchmark's threads."""
    suite = load_config({"HYPNOS_CONFIG": str(SUITE_CONFIG)})
    blocks = [f"[hardware]\nn_threads = {threads}\n"]
    for raw in tomllib.loads(SUITE_CONFIG.read_text())["models"]:
        if raw["id"] not in (GENERATOR_ID, UPSCALER_ID):
            continue
        weights = suite.weights_file(_model(suite, raw["id"])).resolve()
        if not weights.exists():
            raise RuntimeError(f"{weights} is missing (./run.sh setup installs and converts the suite's models)")
        # The package fields only matter to an install.
        fields = {k: v for k, v in raw.items() if k not in ("package", "package_path", "package_parts", "sha256")}
        fields.update(weights_path=str(weights), initial_tier="tier1_gpu_vram")
        blocks.append(_block(fields))
    if diffusion is not None:
        from tests.diffusion_model import build_tiny_diffusion_model

        tiny = build_tiny_diffusion_model(diffusion)
        fields = {"id": DIFFUSION_ID, "modality": "image_generation", "engine": "ggml_diffusion"}
        fields.update(weights_path=str(tiny.weights), aux_path=str(tiny.vae), initial_tier="tier1_gpu_vram")
        image = {"steps": DIFFUSION_STEPS, "cfg_scale": DIFFUSION_CFG_SCALE}
        blocks.append(
            _block(fields) + "[models.image]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in image.items())
        )
        blocks[-1] += f"text_encoders = {{ llm = {json.dumps(str(tiny.text_encoder))} }}\n"
    path = directory / "hypnos.toml"
    path.write_text("\n".join(blocks))
    return path


def _block(fields: dict[str, Any]) -> str:
    # JSON's strings, integers and booleans are TOML's too.
    return "[[models]]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in fields.items())


def server_pass(client: httpx.Client, deployment: Deployment, pictures: dict[int, str]) -> Pass:
    """One pass of a case through the deployment: each request's body built before its clock
    starts, timed from the POST to the last byte of the answer, then decoded and checked."""

    def run(case: Case) -> tuple[Sample, list[bytes]]:
        pngs: list[bytes] = []
        requests: list[Request] = []
        started = time.perf_counter()
        for request in range(case.requests):
            body = json.dumps(_body(case, request, pictures)).encode()
            sent_at, sent = time.time(), time.perf_counter()
            response = client.post(
                f"{deployment.base_url}{_url(case)}", content=body, headers={"content-type": "application/json"}
            )
            secs, received_at = time.perf_counter() - sent, time.time()
            if response.status_code != 200:
                raise RuntimeError(f"POST {_url(case)}: {response.status_code} {response.text[:500]}")
            answer = response.json()
            data = answer["data"]
            if len(data) != case.n:
                raise RuntimeError(f"{case.name}: {len(data)} images for n={case.n}")
            if case.op == "generate" and [item.get("seed") for item in data] != case.seeds(request):
                raise RuntimeError(
                    f"{case.name}: seeds {[item.get('seed') for item in data]}, not {case.seeds(request)}"
                )
            pngs += [base64.b64decode(item["b64_json"]) for item in data]
            telemetry = answer.get("hypnos_telemetry") or {}
            requests.append(
                Request(
                    secs=secs,
                    sent_at=sent_at,
                    received_at=received_at,
                    request_id=response.headers.get("x-request-id"),
                    worker_ms=telemetry.get("inference_latency_ms"),
                    queue_ms=(telemetry.get("engine") or {}).get("queue_ms"),
                    tier_switch_ms=telemetry.get("tier_switch_latency_ms"),
                )
            )
        sample = Sample(secs=time.perf_counter() - started, work=case.work_per_pass, requests=requests)
        sample.digests = [_digest(png) for png in pngs]
        return sample, pngs

    return run


def _url(case: Case) -> str:
    return "/v1/images/generations" if case.op == "generate" else "/v1/images/upscale"


def _body(case: Case, request: int, pictures: dict[int, str]) -> dict[str, Any]:
    if case.op == "generate":
        size = f"{case.side}x{case.side}"
        body = {"model": case.model, "prompt": PROMPT, "n": case.n, "size": size, "seed": case.seeds(request)[0]}
        return body | {k: v for k, v in (("steps", case.steps), ("cfg_scale", case.cfg_scale)) if v is not None}
    return {"model": case.model, "image": pictures[case.side], "upscale_factor": case.factor}


def add_job_times(series: list[Series], deployment: Deployment) -> None:
    """Each request's job row (logs.models.ImageJob, found by the x-request-id) split into:
    before (request sent -> row created: HTTP, checks, spool, model lookup), dispatch (row
    created -> job running: Celery), job (running -> done: the inference worker's call and the
    PNGs relayed) and after (done -> last byte: the done event, base64, JSON, HTTP)."""
    requests = {
        r.request_id: r
        for s in series
        for sample in [s.warmup, *s.runs, *s.discarded]
        if sample
        for r in sample.requests
        if r.request_id
    }
    for request_id, created, started, finished in _job_rows(deployment.database, list(requests)):
        request = requests[request_id]
        if created is None or started is None or finished is None:
            continue
        request.before_ms = (created - request.sent_at) * 1000
        request.dispatch_ms = (started - created) * 1000
        request.job_ms = (finished - started) * 1000
        request.after_ms = (request.received_at - finished) * 1000


def _job_rows(database: str, request_ids: list[str]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(request_id, created_at, started_at, finished_at) of the image job rows, as epoch seconds."""
    query = "SELECT request_id, created_at, started_at, finished_at FROM logs_imagejob WHERE request_id IN ({})"
    if database.startswith("sqlite:///"):
        with sqlite3.connect(database[len("sqlite:///") :], timeout=20) as conn:
            rows = conn.execute(query.format(",".join("?" * len(request_ids))), request_ids).fetchall()
    else:
        import psycopg

        with psycopg.connect(database, connect_timeout=5) as conn:
            rows = conn.execute(query.format(",".join(["%s"] * len(request_ids))), request_ids).fetchall()
    return [(row[0], *(_epoch(value) for value in row[1:])) for row in rows]


def _epoch(value: Any) -> float | None:
    """A Django timestamp (an aware datetime from PostgreSQL, naive UTC text from SQLite)."""
    if value is None:
        return None
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


# -- measuring -----------------------------------------------------------------------------------


def measure_pass(
    series: Series, case: Case, settings: Settings, run: Pass, pids: Callable[[], list[int]], check: PngCheck
) -> None:
    """One measured pass on a quiet machine; a pass during which other processes took more than
    `max_foreign_cpu_pct` of the CPU is measured again, `redo` times at most per series."""
    label = f"{case.name} {series.target} run {len(series.runs) + 1}/{settings.runs}"
    while True:
        idle = wait_until_quiet(settings.wait_idle_secs, label)
        meter = CpuMeter(pids())
        meter.start()
        sample, pngs = run(case)
        sample.idle_before_pct, sample.foreign_cpu_pct = idle, meter.foreign_pct()
        sample.disturbed = (sample.foreign_cpu_pct or 0.0) > settings.max_foreign_cpu_pct
        check(series.target, sample, pngs)
        log.info("%s: %s", label, _describe(case, sample))
        if sample.disturbed and len(series.discarded) < settings.redo:
            log.warning("%s: other processes took %.0f%% of the CPU; measuring it again", label, sample.foreign_cpu_pct)
            series.discarded.append(sample)
            continue
        series.runs.append(sample)
        return


def bench_case(
    case: Case, passes: dict[str, Pass], settings: Settings, pids: Callable[[], list[int]]
) -> tuple[list[Series], PngCheck]:
    """Every target's warm-up, then round after round one measured pass of each target, the
    order turned by one each round, so a change in the shared machine's load reaches every
    target alike. Returns the series and the PNG check of every pass."""
    series = {target: Series(case.name, target) for target in passes}
    checker = PngCheck(case)
    for target, run in passes.items():
        meter = CpuMeter(pids())
        meter.start()
        sample, pngs = run(case)
        sample.foreign_cpu_pct = meter.foreign_pct()
        checker(target, sample, pngs)
        series[target].warmup = sample
        log.info("%s %s warm-up: %s", case.name, target, _describe(case, sample))
    names = list(passes)
    for number in range(settings.runs):
        turn = number % len(names)
        for target in names[turn:] + names[:turn]:
            measure_pass(series[target], case, settings, passes[target], pids, checker)
    return list(series.values()), checker


def count_quiet_rounds(series: list[Series]) -> None:
    """The rounds a case's figures come from: those where no target's pass was disturbed, when
    there are any, else every round. A pass during which other processes held a core runs 2-5
    times slower here (the engines' threads wait for each other at every layer), so one
    disturbed pass in a round would decide its ratio."""
    rounds = range(min(len(s.runs) for s in series))
    quiet = [i for i in rounds if not any(s.runs[i].disturbed for s in series)]
    for s in series:
        s.counted_rounds = quiet or list(rounds)


class PngCheck:
    """Every pass's PNGs against the first pass's of the engine (or of the first target where
    the engine does not run): seeded, they must be the same bytes. A difference is logged at
    once with what differs in the pixels."""

    def __init__(self, case: Case):
        self.case = case
        self.reference: tuple[str, list[bytes]] | None = None
        self.problems: list[str] = []
        self.mismatched: set[str] = set()

    def __call__(self, target: str, sample: Sample, pngs: list[bytes]) -> None:
        if self.reference is None:
            self.reference = (target, pngs)
            return
        name, want = self.reference
        if len(pngs) != len(want):
            self._report(f"{target}: {len(pngs)} PNGs, {name} {len(want)}")
            return
        for index, (got, expected) in enumerate(zip(pngs, want, strict=True)):
            if got != expected:
                self._report(
                    f"{target} image {index}: the PNG differs from {name}'s ({_pixel_difference(got, expected)})"
                )

    def _report(self, problem: str) -> None:
        text = f"{self.case.name}: {problem}"
        log.error("PNG MISMATCH %s", text)
        self.problems.append(text)


def _pixel_difference(got: bytes, expected: bytes) -> str:
    a, b = decode_png(got).astype(np.int16), decode_png(expected).astype(np.int16)
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    diff = np.abs(a - b)
    changed = int((diff.max(axis=2) > 0).sum())
    return f"{changed} of {a.shape[0] * a.shape[1]} pixels differ, by up to {int(diff.max())} levels"


def _describe(case: Case, sample: Sample) -> str:
    text = f"{len(sample.requests)} requests in {sample.secs * 1000:.0f} ms, {sample.rate:.2f} {case.unit}"
    if sample.engine_rate is not None:
        text += f" (engine calls alone {sample.engine_rate:.2f})"
    workers = [r.worker_ms for r in sample.requests if r.worker_ms is not None]
    if workers:
        text += f", worker {statistics.median(workers):.1f} ms/request"
    if sample.foreign_cpu_pct is not None:
        text += f", others {sample.foreign_cpu_pct:.0f}% CPU"
    return text


def answer_encoding_ms(case: Case, pngs: list[bytes]) -> float:
    """What the web process's answer costs on top of the PNGs, measured here on one request's
    PNGs: base64 of each and the JSON of the response (median of 5)."""
    images = pngs[: case.n]
    times = []
    for _ in range(5):
        started = time.perf_counter()
        json.dumps({"created": 0, "data": [{"b64_json": base64.b64encode(png).decode(), "seed": 0} for png in images]})
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


# -- report --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def paired_ratio(series: Series, engine: Series | None, name: str) -> float | None:
    """The median, over the counted rounds, of the series' rate over the engine's `name` rate
    in the same round (a minute apart at most, so a slow drift of the machine's load cancels)."""
    if engine is None:
        return None
    pairs = [
        s.rate / getattr(e, name) for s, e in zip(series.counted, engine.counted, strict=False) if getattr(e, name)
    ]
    return statistics.median(pairs) if pairs else None


def summary(results: list[Series], cases: list[Case], checks: dict[str, PngCheck]) -> list[dict[str, Any]]:
    """One row per case and target (the engine gives two: its calls alone and with the PNG
    work), with the ratios to both engine rows and the check against the target."""
    by_name = {case.name: case for case in cases}
    engines = {s.case: s for s in results if s.target == "engine"}
    rows = []
    for series in results:
        case = by_name[series.case]
        engine = engines.get(series.case)
        mismatched = checks[case.name].mismatched if case.name in checks else set()
        common = {
            "case": case.name,
            "unit": case.unit,
            "runs": len(series.runs),
            "quiet_rounds": len(series.counted) if all(not s.disturbed for s in series.counted) else 0,
            "disturbed_runs": sum(s.disturbed for s in series.runs),
            "discarded_runs": len(series.discarded),
        }
        if series.target == "engine":
            per_request = series.median("engine_secs")
            rows.append(
                {
                    **common,
                    "target": "engine",
                    "rate": series.median("engine_rate"),
                    "ratio_vs_engine_png": paired_ratio_engine(series),
                    "ratio_vs_engine": 1.0,
                    "meets_target": None,
                    "ms_per_request": None if per_request is None else per_request * 1000 / case.requests,
                    "worker_ms_per_request": None,
                    "pngs": "-",
                }
            )
            rows.append(
                {
                    **common,
                    "target": "engine+png",
                    "rate": series.median("rate"),
                    "ratio_vs_engine_png": 1.0,
                    "ratio_vs_engine": paired_ratio(series, engine, "engine_rate"),
                    "meets_target": None,
                    "ms_per_request": _ms(series.request_median("secs")),
                    "worker_ms_per_request": None,
                    "pngs": "reference",
                }
            )
            continue
        ratio = paired_ratio(series, engine, "rate")
        rows.append(
            {
                **common,
                "target": series.target,
                "rate": series.median("rate"),
                "ratio_vs_engine_png": ratio,
                "ratio_vs_engine": paired_ratio(series, engine, "engine_rate"),
                "meets_target": None if ratio is None else ratio >= TARGET_RATIO,
                "ms_per_request": _ms(series.request_median("secs")),
                "worker_ms_per_request": series.request_median("worker_ms"),
                "pngs": "DIFFER" if series.target in mismatched else "same",
            }
        )
    return rows


def paired_ratio_engine(series: Series) -> float | None:
    """The engine calls' rate over the whole pass's (engine+png), per round."""
    pairs = [s.engine_rate / s.rate for s in series.counted if s.engine_rate]
    return statistics.median(pairs) if pairs else None


def _ms(secs: float | None) -> float | None:
    return None if secs is None else secs * 1000


def breakdown(results: list[Series], cases: list[Case], encoding: dict[str, float]) -> list[dict[str, Any]]:
    """Where a server request's time goes (medians over the measured requests), next to the
    engine+png time of the same request."""
    engines = {s.case: s for s in results if s.target == "engine"}
    rows = []
    for series in results:
        if series.target not in SERVERS:
            continue
        engine = engines.get(series.case)
        engine_ms = _ms(engine.request_median("secs")) if engine else None
        request_ms = _ms(series.request_median("secs"))
        rows.append(
            {
                "case": series.case,
                "target": series.target,
                "request_ms": request_ms,
                "before_ms": series.request_median("before_ms"),
                "dispatch_ms": series.request_median("dispatch_ms"),
                "job_ms": series.request_median("job_ms"),
                "worker_ms": series.request_median("worker_ms"),
                "load_ms": series.request_median("tier_switch_ms"),
                "after_ms": series.request_median("after_ms"),
                "engine_png_ms": engine_ms,
                "above_engine_png_ms": None if request_ms is None or engine_ms is None else request_ms - engine_ms,
                "answer_encoding_ms": encoding.get(series.case),
            }
        )
    return rows


def _check(row: dict[str, Any]) -> str:
    if row["meets_target"] is None:
        return "-"
    return "ok" if row["meets_target"] else "BELOW"


def render(header: list[str], body: list[list[str]], left: int) -> str:
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(cells) for cells in body)])


def render_table(rows: list[dict[str, Any]]) -> str:
    header = ["case", "target", "unit", "rate", "vs engine+png", f">= {TARGET_RATIO:g}", "vs engine"]
    header += ["ms/request", "worker ms/request", "PNGs", "quiet rounds"]
    body = [
        [
            row["case"],
            row["target"],
            row["unit"],
            _fmt(row["rate"], 2),
            _fmt(row["ratio_vs_engine_png"], 2),
            _check(row),
            _fmt(row["ratio_vs_engine"], 2),
            _fmt(row["ms_per_request"]),
            _fmt(row["worker_ms_per_request"]),
            row["pngs"],
            f"{row['quiet_rounds']}/{row['runs']}",
        ]
        for row in rows
    ]
    return render(header, body, 3)


def render_breakdown(rows: list[dict[str, Any]]) -> str:
    header = ["case", "target", "request ms", "before", "dispatch", "job", "(worker)", "(load)", "after"]
    header += ["engine+png ms", "above engine+png", "b64+JSON ms"]
    keys = ["request_ms", "before_ms", "dispatch_ms", "job_ms", "worker_ms", "load_ms", "after_ms", "engine_png_ms"]
    keys += ["above_engine_png_ms"]
    body = [
        [row["case"], row["target"], *(_fmt(row[k]) for k in keys), _fmt(row["answer_encoding_ms"], 2)] for row in rows
    ]
    return render(header, body, 2)


def machine_line(settings: Settings, load_before: tuple[float, float, float], diffusion: bool) -> str:
    load_after = os.getloadavg()
    sdcpp = f", stable-diffusion-cpp-python {version('stable-diffusion-cpp-python')}" if diffusion else ""
    return (
        f"machine: {os.cpu_count()} cores, shared with other engineers' work (load average "
        f"{load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end); onnxruntime "
        f"{version('onnxruntime')}, ncnn {version('ncnn')}{sdcpp}, Pillow {version('pillow')}; "
        f"{settings.threads} engine threads; distributed database {settings.database}"
    )


def _version_or_none(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _diffusion_available() -> bool:
    """stable-diffusion-cpp-python is the wheel ./run.sh builds once per machine (setup_sdcpp)."""
    try:
        import stable_diffusion_cpp  # noqa: F401
    except ImportError as exc:
        log.warning("no diffusion case: stable-diffusion-cpp-python is not installed (%s)", exc)
        return False
    return True


def conditions_line(rows: list[dict[str, Any]], settings: Settings) -> str:
    counted = [row for row in rows if row["target"] != "engine+png"]  # the engine's passes once
    disturbed = sum(row["disturbed_runs"] for row in counted)
    redone = sum(row["discarded_runs"] for row in counted)
    runs = sum(row["runs"] for row in counted)
    return (
        f"runs disturbed by other processes (>{settings.max_foreign_cpu_pct:g}% of the CPU): {disturbed}/{runs} "
        f"kept, {redone} redone"
    )


def pngs_line(checks: dict[str, PngCheck], results: list[Series]) -> str:
    found = [p for check in checks.values() for p in check.problems]
    if found:
        return f"PNG MISMATCH: {len(found)} PNGs differ from the engine's (see the log): not like for like"
    pngs = sum(len(s.digests) for series in results for s in [series.warmup, *series.runs, *series.discarded] if s)
    return f"PNGs: all {pngs} the same bytes as the engine's of the same seed or picture"


def reloads_line(results: list[Series]) -> str | None:
    """The server series whose measured requests loaded the model although it was in tier 1
    (hypnos_telemetry.tier_switch_latency_ms above 0): then every request pays a load."""
    found = []
    for series in results:
        requests = [r for s in series.runs for r in s.requests]
        loads = [r.tier_switch_ms for r in requests if r.tier_switch_ms]
        if loads:
            found.append(
                f"{series.case} {series.target} {len(loads)}/{len(requests)} (median {statistics.median(loads):.0f} ms)"
            )
    if not found:
        return None
    return "MODEL RELOADED inside measured requests (tier_switch_latency_ms > 0, the model in tier 1): " + "; ".join(
        found
    )


def write_json(path: Path, settings: Settings, results: list[Series], tables: dict[str, Any]) -> None:
    document = {
        "benchmark": "bench/images.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {**asdict(settings), "prompt": PROMPT, "base_seed": BASE_SEED},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "onnxruntime": version("onnxruntime"),
            "ncnn": version("ncnn"),
            "pillow": version("pillow"),
            "stable_diffusion_cpp_python": _version_or_none("stable-diffusion-cpp-python"),
        },
        **tables,
        "series": [asdict(series) for series in results],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    log.info("wrote %s", path)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="measured passes per case and target (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 1 pass, 16 images a pass, the 128 px picture only"
    )
    parser.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    parser.add_argument(
        "--images", type=int, default=None, help="images per generator pass, a multiple of 4 (default 32)"
    )
    parser.add_argument("--only", action="append", choices=TARGETS, help="run only this target (repeatable)")
    parser.add_argument("--no-diffusion", action="store_true", help="leave the diffusion case out")
    parser.add_argument("--case", action="append", help="run only this case, e.g. 'upscale 512 x4' (repeatable)")
    parser.add_argument(
        "--database",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="the distributed deployment's database: PostgreSQL on 127.0.0.1:5432 (default), or a SQLite file",
    )
    parser.add_argument("--wait-idle", type=float, default=2.0, metavar="SECS", help="wait for a quiet CPU (default 2)")
    parser.add_argument(
        "--max-foreign-cpu", type=float, default=10.0, metavar="PCT", help="redo a run above (default 10)"
    )
    parser.add_argument("--redo", type=int, default=1, metavar="N", help="redone runs per series (default 1)")
    parser.add_argument("--json", type=Path, help="also write every pass and the summary to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.images = args.images or (16 if args.quick else 32)
    if min(args.runs, args.threads) < 1 or args.images < 4 or args.images % 4:
        parser.error("--runs and --threads must be >= 1, --images a multiple of 4")
    return args


def run_targets(
    targets: list[str], cases: list[Case], settings: Settings
) -> tuple[list[Series], dict[str, PngCheck], dict[str, float]]:
    """Every deployment started at once (an idle one takes no CPU) and the engines loaded
    here, then case by case the targets measured in turn (bench_case)."""
    pictures = {side: test_picture(side) for side in sorted({c.side for c in cases if c.op == "upscale"})}
    encoded = {side: base64.b64encode(data).decode() for side, data in pictures.items()}
    results: list[Series] = []
    checks: dict[str, PngCheck] = {}
    encoding: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-images-") as tmp, ExitStack() as stack:
        work_dir = Path(tmp)
        diffusion = any(c.model == DIFFUSION_ID for c in cases)
        config_path = write_config(work_dir, settings.threads, work_dir / "diffusion" if diffusion else None)
        deployments = [
            stack.enter_context(running_server(name, config_path, work_dir, settings.database))
            for name in targets
            if name in SERVERS
        ]
        client = stack.enter_context(httpx.Client(timeout=REQUEST_TIMEOUT_SECS))
        passes: dict[str, Pass] = {}
        if "engine" in targets:
            model_ids = list(dict.fromkeys(c.model for c in cases))
            engines = DirectEngines(load_config({"HYPNOS_CONFIG": str(config_path)}), model_ids, pictures)
            stack.callback(engines.close)
            passes["engine"] = engines.run
        passes |= {d.name: server_pass(client, d, encoded) for d in deployments}
        pids = own_pids([p for d in deployments for p in d.procs], any(d.name == "distributed" for d in deployments))
        for case in cases:
            series, checks[case.name] = bench_case(case, passes, settings, pids)
            count_quiet_rounds(series)
            for deployment in deployments:
                add_job_times([s for s in series if s.target == deployment.name], deployment)
            reference = checks[case.name].reference
            if reference is not None:
                encoding[case.name] = answer_encoding_ms(case, reference[1])
            results += series
    return results, checks, encoding


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # stable-diffusion.cpp's own log lines (inference/engines/diffusion.py sends them to logging).
    logging.getLogger("inference.engines.diffusion").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    settings = Settings(
        runs=args.runs,
        threads=args.threads,
        images=args.images,
        quick=args.quick,
        wait_idle_secs=args.wait_idle,
        max_foreign_cpu_pct=args.max_foreign_cpu,
        redo=args.redo,
        database=args.database,
    )
    targets = [t for t in TARGETS if t in (args.only or TARGETS)]
    diffusion = not args.no_diffusion and _diffusion_available()
    cases = build_cases(settings.images, settings.quick, diffusion)
    if args.case:
        unknown = set(args.case) - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"unknown case {sorted(unknown)}; the cases: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in args.case]
    load_before = os.getloadavg()
    started = time.monotonic()
    results, checks, encoding = run_targets(targets, cases, settings)
    problems = {name: check.problems for name, check in checks.items()}
    rows = summary(results, cases, checks)
    where = breakdown(results, cases, encoding)
    print(
        f"images: {settings.runs} passes per case and target after 1 warm-up, interleaved by round; "
        f"{GENERATOR_ID} {GENERATOR_SIZE}x{GENERATOR_SIZE}, {settings.images} images a pass; "
        + (
            f"{DIFFUSION_ID} (random weights: plumbing) {DIFFUSION_SIZE}x{DIFFUSION_SIZE}, {DIFFUSION_STEPS} step; "
            if diffusion
            else "no diffusion model; "
        )
        + f"seeds from {BASE_SEED}; {UPSCALER_ID} on a built picture; wall time of the pass (servers: of the "
        "HTTP requests)"
    )
    print(machine_line(settings, load_before, diffusion))
    print(render_table(rows))
    print()
    print("where a server request's time goes, ms per request (medians; job rows' timestamps):")
    print(render_breakdown(where))
    print(pngs_line(checks, results))
    reloads = reloads_line(results)
    if reloads:
        print(reloads)
    print(conditions_line(rows, settings) + f"; the run took {time.monotonic() - started:.0f} s")
    if args.json:
        write_json(args.json, settings, results, {"summary": rows, "breakdown": where, "png_problems": problems})
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; every server this run started has been stopped")
        sys.exit(130)
