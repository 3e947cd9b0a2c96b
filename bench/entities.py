"""Entity extraction benchmark: texts/s of POST /v1/entities (spec §13) through Hypnos (embedded
and distributed) against the engine called directly on the same texts, in one run.

Two extractors:

- ``chat``: the chat-model extractor on Qwen2.5-Coder-0.5B (``qwen2.5-coder-0.5b``, a block
  with ``additional_modalities = ["entity_extraction"]``): one greedy answer per text under the
  labels' JSON-schema grammar. ``engine`` runs inference/worker/entities.py's ``ChatExtractor``
  in this process on a ``LlamaEngine`` loaded here, with no server, worker or channel layer (a
  stand-in for the worker's tier moves only prepares each chat on the loaded engine);
- ``gliner``: ``GlinerEngine.extract`` on a GLiNER-shaped ONNX folder built at run time with
  tests/gliner_graph.py (lookup tables with known scores: plumbing, not a trained model).

Both deployments run for the whole benchmark and the engine is loaded here next to them; one
target works at a time. Each gets one warm-up pass over the texts, then ``--runs`` measured
passes, interleaved round by round with the other targets' (the machine is shared, and its load
drifts), sent one text per request (``single``) and all texts in one request (``batch``). The
table shows medians, the ratio to the engine's pass of the same round and mode, and the check
against the target (a server keeps at least 0.9 of the engine's texts/s). Every target must
return the same spans. bench/README.md describes the method.

    .venv/bin/python bench/entities.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402

from bench.chat_stream import (  # noqa: E402
    CpuMeter,
    Proc,
    _stop_on_sigterm,
    wait_until_quiet,
)
from bench.deployments import running_server  # noqa: E402
from bench.documents import own_pids  # noqa: E402
from hypnos_site.config import HypnosConfig, LimitsConfig, ModelConfig, load_config  # noqa: E402

log = logging.getLogger("bench.entities")

EXTRACTORS = ("chat", "gliner")
TARGETS = ("engine", "embedded", "distributed")
SERVERS = ("embedded", "distributed")
MODES = ("single", "batch")
CHAT_MODEL_ID = "qwen2.5-coder-0.5b"
GLINER_MODEL_ID = "gliner-plumbing"
URL = "/v1/entities"
SUITE_CONFIG = BASE_DIR / "tests" / "hypnos.test.toml"
CONTEXT_LEN = 4096
# The target: a server keeps at least this share of the engine's texts/s.
TARGET_RATIO = 0.9
REQUEST_TIMEOUT_SECS = 600.0
# Scores of the same span from two targets may differ by this much and still count as the same
# answer (the chat path rounds to 4 digits; a prompt cache reused or not can move the last one).
SCORE_TOLERANCE = 1e-3
MAX_LOGGED_DIFFERENCES = 20
# The width of the dense layers add_encoder_work gives the GLiNER graph: a base-size encoder's.
ENCODER_WIDTH = 768
# A base-size encoder's matrix work: 12 transformer layers of 12 width x width products each
# (attention's four projections, and the feed-forward's two, four times as wide: eight).
DEFAULT_ENCODER_LAYERS = 144

# The spec's two sentences (§13) first, then the two more tests/gliner_graph.py's tables know,
# then six the GLiNER graph has no entry for (every word of them scores its default: no span).
TEXTS = [
    "Mario Rossi works in Milan for Ferrari.",
    "Tim Cook announced the iPhone 17 in Cupertino.",
    "Anna opened an account at the Bank of Milan.",
    "Luca joined Juventus in Turin.",
    "Satya Nadella said Microsoft will ship Windows 12 next year.",
    "Toyota builds the Corolla at its plant near Nagoya.",
    "Sundar Pichai showed the Pixel 9 to reporters in London.",
    "Lisa Su presented the Ryzen 9 for AMD in Taipei.",
    "Jeff Bezos founded Amazon in Seattle and later launched the Kindle.",
    "Sophie Martin bought a ThinkPad from Lenovo in Lyon.",
]
LABELS = ["person", "city", "company", "product"]
THRESHOLD = 0.5
FLAT = True

# One span as it is compared and written: (start, end, label, score).
Found = tuple[int, int, str, float]
# One extraction of some texts: each text's spans, and the time the engine spent on them (the
# server's hypnos_telemetry.inference_latency_ms), in ms.
Call = Callable[[list[str]], tuple[list[list[Found]], float | None]]


@dataclass
class Sample:
    """One pass over the texts: the wall time of every request together, and what came back."""

    secs: float
    texts: int
    requests: int
    inference_ms: float | None = None
    spans: list[list[Found]] = field(default_factory=list)
    idle_before_pct: float | None = None
    foreign_cpu_pct: float | None = None
    disturbed: bool = False

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.secs

    @property
    def inference_share(self) -> float | None:
        """The share of the pass the engine spent extracting: what the target keeps of its own
        engine's throughput. Measured within one pass, so the machine's load cancels."""
        return None if self.inference_ms is None else self.inference_ms / (self.secs * 1000)

    @property
    def outside_ms_per_request(self) -> float | None:
        """The time a request took beyond the extraction itself (engine: preparing the chats;
        server: that plus HTTP, the worker and the channel layer)."""
        if self.inference_ms is None:
            return None
        return (self.secs * 1000 - self.inference_ms) / self.requests


@dataclass
class Series:
    """Every pass of one extractor through one target in one mode, and their medians."""

    extractor: str
    target: str
    mode: str
    warmup: Sample | None = None
    runs: list[Sample] = field(default_factory=list)
    discarded: list[Sample] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.runs if getattr(s, name) is not None]
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class Settings:
    runs: int
    threads: int
    wait_idle_secs: float
    max_foreign_cpu_pct: float
    redo: int
    gliner_head: str
    gliner_max_width: int
    gliner_rounds: int
    gliner_encoder_layers: int

    def rounds(self, extractor: str) -> int:
        return self.gliner_rounds if extractor == "gliner" else 1


# -- measuring -----------------------------------------------------------------------------------


def one_pass(call: Call, mode: str, rounds: int) -> Sample:
    """`rounds` times every text: one request per text (`single`) or one request of all the
    texts per round (`batch`)."""
    requests = ([[text] for text in TEXTS] if mode == "single" else [list(TEXTS)]) * rounds
    spans: list[list[Found]] = []
    inference_ms: float | None = 0.0
    started = time.perf_counter()
    for texts in requests:
        found, ms = call(texts)
        spans += found
        inference_ms = None if ms is None or inference_ms is None else inference_ms + ms
    secs = time.perf_counter() - started
    if len(spans) != len(TEXTS) * rounds:
        raise RuntimeError(f"{len(spans)} answers for {len(TEXTS) * rounds} texts")
    return Sample(secs=secs, texts=len(spans), requests=len(requests), inference_ms=inference_ms, spans=spans)


def warm_up(series: Series, settings: Settings, call: Call) -> None:
    series.warmup = one_pass(call, series.mode, settings.rounds(series.extractor))
    log.info("%s %s %s warm-up: %s", series.extractor, series.target, series.mode, _describe(series.warmup))


def measure_pass(series: Series, settings: Settings, call: Call, pids: Callable[[], list[int]]) -> None:
    """One measured pass, on a quiet machine; a pass during which other processes took more
    than `max_foreign_cpu_pct` of the CPU is measured again, `redo` times at most per series
    (the machine is shared)."""
    label = f"{series.extractor} {series.target} {series.mode} run {len(series.runs) + 1}/{settings.runs}"
    while True:
        idle = wait_until_quiet(settings.wait_idle_secs, label)
        meter = CpuMeter(pids())
        meter.start()
        sample = one_pass(call, series.mode, settings.rounds(series.extractor))
        sample.idle_before_pct, sample.foreign_cpu_pct = idle, meter.foreign_pct()
        sample.disturbed = (sample.foreign_cpu_pct or 0.0) > settings.max_foreign_cpu_pct
        log.info("%s: %s", label, _describe(sample))
        if sample.disturbed and len(series.discarded) < settings.redo:
            log.warning("%s: other processes took %.0f%% of the CPU; measuring it again", label, sample.foreign_cpu_pct)
            series.discarded.append(sample)
            continue
        series.runs.append(sample)
        return


def bench_extractor(
    extractor: str, calls: dict[str, Call], settings: Settings, pids: Callable[[], list[int]]
) -> list[Series]:
    """Both modes; in each, every target's warm-up, then round after round one measured pass
    of each target, the order turned by one each round, so a change in the machine's load
    (it is shared) reaches every target alike rather than the one measured during it."""
    results: list[Series] = []
    for mode in MODES:
        series = {target: Series(extractor, target, mode) for target in calls}
        for target, call in calls.items():
            warm_up(series[target], settings, call)
        names = list(calls)
        for number in range(settings.runs):
            turn = number % len(names)
            for target in names[turn:] + names[:turn]:
                measure_pass(series[target], settings, calls[target], pids)
        results += series.values()
    return results


def _describe(sample: Sample) -> str:
    spans = sum(len(found) for found in sample.spans)
    text = f"{sample.texts} texts ({spans} spans) in {sample.secs * 1000:.0f} ms, {sample.texts_per_s:.2f} texts/s"
    if sample.inference_ms is not None:
        text += f", inference {sample.inference_ms:.0f} ms"
    if sample.foreign_cpu_pct is not None:
        text += f", others {sample.foreign_cpu_pct:.0f}% CPU"
    return text


# -- the engines, called directly ----------------------------------------------------------------


def prepared_here(engine: Any, limits: LimitsConfig) -> Any:
    """ChatExtractor's prepare_chat for an engine this process loaded itself: each chat
    prepared (rendered, tokenised, its grammar built) and checked against the context, as
    TierMoves.prepare_chat does once the model is in tier 1; nothing moves."""
    from inference.worker.tier_moves import TierSwitch
    from memory.tiers import MemoryTier

    def prepare(work: Any) -> tuple[Any, Any]:
        prepared = engine.prepare_chat(work, limits)
        engine.check_context(prepared)
        return prepared, TierSwitch(previous_tier=MemoryTier.TIER1)

    return prepare


def chat_direct(engine: Any, model: ModelConfig, limits: LimitsConfig) -> Call:
    """ChatExtractor on the loaded engine, as serve_entities drives it: every text prepared,
    then extracted one by one; the time of the extraction loop as the worker's inference_ms."""
    from inference.transport.wire import EntityWork
    from inference.worker.entities import ChatExtractor

    def call(texts: list[str]) -> tuple[list[list[Found]], float | None]:
        work = EntityWork(input=texts, labels=LABELS, threshold=THRESHOLD, flat=FLAT)
        extractor = ChatExtractor(engine, work, threading.Event(), prepared_here(engine, limits))
        extractor.prepare()
        started = time.perf_counter()
        found = [extractor.extract(index) for index in range(len(texts))]
        inference_ms = (time.perf_counter() - started) * 1000
        return [[_found(s.start, s.end, s.label, s.score) for s in spans] for spans in found], inference_ms

    return call


def gliner_direct(engine: Any) -> Call:
    """GlinerEngine.extract, as serve_entities calls it."""

    def call(texts: list[str]) -> tuple[list[list[Found]], float | None]:
        started = time.perf_counter()
        found = engine.extract(texts, LABELS, THRESHOLD, FLAT, threading.Event())
        inference_ms = (time.perf_counter() - started) * 1000
        return [[_found(s.start, s.end, s.label, s.score) for s in spans] for spans in found], inference_ms

    return call


def _found(start: int, end: int, label: str, score: float) -> Found:
    return (start, end, label, float(score))


@contextmanager
def direct_engine(extractor: str, config: HypnosConfig) -> Iterator[Call]:
    """The server's engine without the server, loaded here as the worker loads it (the same
    model block, threads and context), and the call that extracts on it; cooled afterwards."""
    from inference.engines.base import engine_class

    model = _model(config, extractor)
    engine = engine_class(model.engine, model.modality)(model, config.weights_file(model), config.hardware.n_threads)
    phases = engine.load(model.context_len, 0)
    log.info("%s engine loaded in %.0f ms", extractor, phases.total_ms)
    try:
        yield chat_direct(engine, model, config.limits) if extractor == "chat" else gliner_direct(engine)
    finally:
        engine.cool()


def _model(config: HypnosConfig, extractor: str) -> ModelConfig:
    wanted = CHAT_MODEL_ID if extractor == "chat" else GLINER_MODEL_ID
    return next(m for m in config.models if m.id == wanted)


# -- the Hypnos server ---------------------------------------------------------------------------


def write_config(directory: Path, extractors: list[str], threads: int, gliner_folder: Path | None) -> Path:
    """The models the run needs and the benchmark's threads: the suite's Qwen2.5-Coder-0.5B block
    (its weights by absolute path, context_len 4096, in tier 1 from the start) and a GLiNER block
    on the built folder."""
    blocks = [f"[hardware]\nn_threads = {threads}\n"]
    if "chat" in extractors:
        suite = load_config({"HYPNOS_CONFIG": str(SUITE_CONFIG)})
        block = tomllib.loads(SUITE_CONFIG.read_text())["models"]
        qwen = next(b for b in block if b["id"] == CHAT_MODEL_ID)
        weights = suite.weights_file(next(m for m in suite.models if m.id == CHAT_MODEL_ID)).resolve()
        if not weights.is_file():
            raise RuntimeError(f"{weights} is missing (./run.sh setup installs the suite's models)")
        # The package and checksum only matter to an install.
        fields = {k: v for k, v in qwen.items() if k not in ("package", "package_parts", "sha256")}
        fields.update(weights_path=str(weights), context_len=CONTEXT_LEN, initial_tier="tier1_gpu_vram")
        blocks.append(_block(fields))
    if "gliner" in extractors:
        assert gliner_folder is not None
        blocks.append(
            _block(
                {
                    "id": GLINER_MODEL_ID,
                    "modality": "entity_extraction",
                    "engine": "gliner",
                    "weights_path": str(gliner_folder.resolve()),
                    "initial_tier": "tier1_gpu_vram",
                }
            )
        )
    path = directory / "hypnos.toml"
    path.write_text("\n".join(blocks))
    return path


def _block(fields: dict[str, Any]) -> str:
    # JSON's strings, integers, booleans and lists of strings are TOML's too.
    return "[[models]]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in fields.items())


def build_gliner(folder: Path, settings: Settings) -> Path:
    """The GLiNER-shaped model folder (tests/gliner_graph.py): a graph of lookup tables with
    known scores, not a trained model (no GLiNER weights reach this machine), with
    `gliner_encoder_layers` dense layers of encoder-like work added to it."""
    from tests.gliner_graph import build_gliner_model

    built = build_gliner_model(folder, head=settings.gliner_head, max_width=settings.gliner_max_width)
    if settings.gliner_encoder_layers:
        add_encoder_work(built / "onnx" / "model.onnx", settings.gliner_encoder_layers)
    return built


def add_encoder_work(graph_path: Path, layers: int) -> None:
    """Give the lookup-table graph an encoder's matrix work, so the engine's time is not
    negligible next to the server's: every token's id, widened to ENCODER_WIDTH, goes through
    `layers` tanh(x @ W) layers (one shared W: the work of a layer, not its weights), and the
    result, times zero, is added to the logits. tanh keeps it finite, so the logits, and every
    score, are exactly the builder's."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_path))
    graph = model.graph
    producer = next(node for node in graph.node if "logits" in node.output)
    producer.output[list(producer.output).index("logits")] = "table_logits"
    rng = np.random.default_rng(0)
    weights = {
        "load_widen": (rng.standard_normal((1, ENCODER_WIDTH)) / 100).astype(np.float32),
        "load_w": (rng.standard_normal((ENCODER_WIDTH, ENCODER_WIDTH)) / np.sqrt(ENCODER_WIDTH)).astype(np.float32),
        "load_axis": np.array([2], dtype=np.int64),
        "load_zero": np.zeros((), dtype=np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in weights.items())
    n = helper.make_node
    nodes = [
        n("Cast", ["input_ids"], ["load_ids"], to=onnx.TensorProto.FLOAT),
        n("Unsqueeze", ["load_ids", "load_axis"], ["load_ids_3d"]),
        n("MatMul", ["load_ids_3d", "load_widen"], ["load_0"]),
    ]
    for layer in range(layers):
        nodes += [
            n("MatMul", [f"load_{layer}", "load_w"], [f"load_mm_{layer}"]),
            n("Tanh", [f"load_mm_{layer}"], [f"load_{layer + 1}"]),
        ]
    nodes += [
        n("ReduceSum", [f"load_{layers}"], ["load_sum"], keepdims=0),
        n("Mul", ["load_sum", "load_zero"], ["load_nothing"]),
        n("Add", ["table_logits", "load_nothing"], ["logits"]),
    ]
    graph.node.extend(nodes)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(graph_path))


def known_gliner_spans(settings: Settings) -> list[list[Found]]:
    """Each text's answer from the builder's own scores (tests/gliner_graph.py computes them in
    plain Python), made flat or nested as the engine makes it."""
    from inference.transport.entities import select_spans
    from tests.gliner_graph import span_candidates, token_candidates

    def candidates(text: str) -> list[Any]:
        if settings.gliner_head == "span":
            return span_candidates(text, LABELS, THRESHOLD, settings.gliner_max_width)
        return token_candidates(text, LABELS, THRESHOLD)

    return [[_found(s.start, s.end, s.label, s.score) for s in select_spans(candidates(t), FLAT)] for t in TEXTS]


def server_call(client: httpx.Client, base_url: str, model_id: str) -> Call:
    """One POST /v1/entities of the texts; the spans as the answer gives them, and the worker's
    inference_latency_ms."""

    def call(texts: list[str]) -> tuple[list[list[Found]], float | None]:
        body = {"model": model_id, "input": texts, "labels": LABELS, "threshold": THRESHOLD, "flat": FLAT}
        response = client.post(f"{base_url}{URL}", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST {URL}: {response.status_code} {response.text[:500]}")
        answer = response.json()
        data = sorted(answer["data"], key=lambda item: item["index"])
        found = [[_found(e["start"], e["end"], e["label"], e["score"]) for e in item["entities"]] for item in data]
        return found, (answer.get("hypnos_telemetry") or {}).get("inference_latency_ms")

    return call


# -- the same spans everywhere -------------------------------------------------------------------


def check_same_spans(results: list[Series], known: dict[str, list[list[Found]]]) -> tuple[list[str], dict[str, float]]:
    """Every text of every pass of every target against its reference: the known answer where
    there is one (the GLiNER graph's own scores), else the same text in the first measured
    engine pass of the extractor (or the first pass there is). The same spans (offsets and
    labels), scores within SCORE_TOLERANCE. Returns the differences and, per extractor, the
    largest score gap."""
    problems: list[str] = []
    gaps: dict[str, float] = {}
    for extractor in dict.fromkeys(s.extractor for s in results):
        series = [s for s in results if s.extractor == extractor]
        name, reference = _reference(series, known.get(extractor))
        gaps[extractor] = 0.0
        for s in series:
            for number, sample in enumerate([s.warmup, *s.runs, *s.discarded]):
                for index, got in enumerate(sample.spans if sample else []):
                    want = reference[index % len(TEXTS)]
                    if [f[:3] for f in got] != [f[:3] for f in want]:
                        problems.append(
                            f"{extractor} {s.target} {s.mode} pass {number} text {index % len(TEXTS)} "
                            f"({TEXTS[index % len(TEXTS)]!r}): {_spans_text(got)} != {name} {_spans_text(want)}"
                        )
                        continue
                    for a, b in zip(got, want, strict=True):
                        gaps[extractor] = max(gaps[extractor], abs(a[3] - b[3]))
        if gaps[extractor] > SCORE_TOLERANCE:
            problems.append(f"{extractor}: scores of the same spans differ by up to {gaps[extractor]:.4f}")
    return problems, gaps


def _reference(series: list[Series], known: list[list[Found]] | None) -> tuple[str, list[list[Found]]]:
    if known is not None:
        return "the graph's own scores", known
    first = next((s for s in series if s.target == "engine"), series[0])
    sample = first.runs[0] if first.runs else first.warmup
    assert sample is not None
    return f"{first.target} {first.mode}", sample.spans[: len(TEXTS)]


def _spans_text(spans: list[Found]) -> str:
    return "[" + ", ".join(f"{start}-{end} {label}" for start, end, label, _ in spans) + "]"


# -- report --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(results: list[Series]) -> list[dict[str, Any]]:
    """One row per extractor, target and mode: medians, the ratio to the engine in the same mode,
    and the check against the target (server rows)."""
    engines = {(s.extractor, s.mode): s for s in results if s.target == "engine"}
    rows = []
    for series in results:
        rate = series.median("texts_per_s")
        ratio = paired_ratio(series, engines.get((series.extractor, series.mode)))
        inference = series.median("inference_ms")
        rows.append(
            {
                "extractor": series.extractor,
                "target": series.target,
                "mode": series.mode,
                "texts_per_s": rate,
                "ratio_vs_engine": ratio,
                "meets_target": (ratio >= TARGET_RATIO) if series.target in SERVERS and ratio is not None else None,
                "request_ms_per_text": 1000 / rate if rate else None,
                "inference_ms_per_text": None
                if inference is None or not series.runs
                else inference / series.runs[0].texts,
                "outside_ms_per_request": series.median("outside_ms_per_request"),
                "inference_share": series.median("inference_share"),
                # Per round over the texts.
                "spans": sum(len(found) for found in series.runs[0].spans[: len(TEXTS)]) if series.runs else None,
                "runs": len(series.runs),
                "disturbed_runs": sum(s.disturbed for s in series.runs),
                "discarded_runs": len(series.discarded),
            }
        )
    return rows


def paired_ratio(series: Series, engine: Series | None) -> float | None:
    """The median, over the rounds, of the series' texts/s over the engine's in the same round
    (measured minutes apart at most, so a slow drift of the machine's load cancels)."""
    if engine is None:
        return None
    pairs = [s.texts_per_s / e.texts_per_s for s, e in zip(series.runs, engine.runs, strict=False)]
    return statistics.median(pairs) if pairs else None


def _check(row: dict[str, Any]) -> str:
    if row["meets_target"] is None:
        return "-"
    return "ok" if row["meets_target"] else "BELOW"


def render_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "extractor",
        "target",
        "mode",
        "texts/s",
        "vs engine",
        f">= {TARGET_RATIO:g}",
        "ms/text",
        "inference ms/text",
        "outside ms/request",
        "inference share",
        "spans",
    ]
    body = [
        [
            row["extractor"],
            row["target"],
            row["mode"],
            _fmt(row["texts_per_s"], 2),
            _fmt(row["ratio_vs_engine"], 2),
            _check(row),
            _fmt(row["request_ms_per_text"]),
            _fmt(row["inference_ms_per_text"]),
            _fmt(row["outside_ms_per_request"]),
            _fmt(row["inference_share"], 3),
            "-" if row["spans"] is None else str(row["spans"]),
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(cells) for cells in body)])


def machine_line(settings: Settings, load_before: tuple[float, float, float]) -> str:
    load_after = os.getloadavg()
    return (
        f"machine: {os.cpu_count()} cores, shared with other engineers' work (load average "
        f"{load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end); llama-cpp-python "
        f"{version('llama-cpp-python')}, onnxruntime {version('onnxruntime')}; {settings.threads} engine threads"
    )


def conditions_line(rows: list[dict[str, Any]], settings: Settings) -> str:
    disturbed = sum(row["disturbed_runs"] for row in rows)
    redone = sum(row["discarded_runs"] for row in rows)
    runs = sum(row["runs"] for row in rows)
    return (
        f"runs disturbed by other processes (>{settings.max_foreign_cpu_pct:g}% of the CPU): {disturbed}/{runs} "
        f"kept, {redone} redone"
    )


def spans_line(problems: list[str], gaps: dict[str, float], known: dict[str, Any]) -> str:
    if problems:
        return f"SPANS DIFFER ({len(problems)} differences; see the log): not like for like"
    parts = []
    for extractor, gap in gaps.items():
        reference = "the graph's own scores" if extractor in known else "the engine"
        parts.append(
            f"{extractor}: every pass of every target gave the spans of {reference} (largest score gap {gap:.4f})"
        )
    return "spans: " + "; ".join(parts)


def write_json(
    path: Path, settings: Settings, results: list[Series], rows: list[dict[str, Any]], problems: list[str]
) -> None:
    document = {
        "benchmark": "bench/entities.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {**asdict(settings), "texts": TEXTS, "labels": LABELS, "threshold": THRESHOLD, "flat": FLAT},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "llama_cpp_python": version("llama-cpp-python"),
            "onnxruntime": version("onnxruntime"),
        },
        "summary": rows,
        "span_differences": problems,
        "series": [asdict(series) for series in results],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    log.info("wrote %s", path)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="measured passes per series (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    parser.add_argument("--only", action="append", choices=TARGETS, help="run only this target (repeatable)")
    parser.add_argument("--extractor", action="append", choices=EXTRACTORS, help="run only this extractor (repeatable)")
    parser.add_argument(
        "--gliner-head", choices=("span", "token"), default="span", help="the GLiNER graph's head (default span)"
    )
    parser.add_argument(
        "--gliner-max-width", type=int, default=12, help="the span head's widest span in words (default 12)"
    )
    parser.add_argument(
        "--gliner-encoder-layers",
        type=int,
        default=DEFAULT_ENCODER_LAYERS,
        metavar="L",
        help=f"dense {ENCODER_WIDTH}-wide layers of work added to the GLiNER graph; 0: the builder's graph "
        f"as it is (default {DEFAULT_ENCODER_LAYERS}: a base-size encoder's matrix work)",
    )
    parser.add_argument(
        "--gliner-rounds",
        type=int,
        metavar="R",
        help="GLiNER passes go over the texts R times, so a pass lasts long enough to time "
        "(default 5, or 50 without encoder layers)",
    )
    parser.add_argument(
        "--wait-idle", type=float, default=30.0, metavar="SECS", help="wait for a quiet CPU (default 30)"
    )
    parser.add_argument(
        "--max-foreign-cpu", type=float, default=10.0, metavar="PCT", help="redo a run above (default 10)"
    )
    parser.add_argument("--redo", type=int, default=None, metavar="N", help="redone runs per series (default: --runs)")
    parser.add_argument("--json", type=Path, help="also write every pass and the summary to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.gliner_rounds is None:
        args.gliner_rounds = 5 if args.gliner_encoder_layers else 50
    if min(args.runs, args.threads, args.gliner_max_width, args.gliner_rounds) < 1 or args.gliner_encoder_layers < 0:
        parser.error(
            "--runs, --threads, --gliner-max-width and --gliner-rounds must be >= 1, --gliner-encoder-layers >= 0"
        )
    return args


def run_targets(targets: list[str], extractors: list[str], settings: Settings) -> list[Series]:
    """Every deployment started at once (an idle one takes no CPU), then extractor by extractor
    its engine loaded here and the targets measured in turn (bench_extractor)."""
    results: list[Series] = []
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-entities-") as tmp, ExitStack() as servers:
        work_dir = Path(tmp)
        gliner = build_gliner(work_dir / "gliner", settings) if "gliner" in extractors else None
        config_path = write_config(work_dir, extractors, settings.threads, gliner)
        config = load_config({"HYPNOS_CONFIG": str(config_path)})
        base_urls: dict[str, str] = {}
        procs: list[Proc] = []
        for deployment in (t for t in targets if t in SERVERS):
            server = servers.enter_context(running_server(deployment, config_path, work_dir))
            base_urls[deployment] = server.base_url
            procs += server.procs
        client = servers.enter_context(httpx.Client(timeout=REQUEST_TIMEOUT_SECS))
        pids = own_pids(procs, "distributed" in base_urls)
        for extractor in extractors:
            model_id = CHAT_MODEL_ID if extractor == "chat" else GLINER_MODEL_ID
            with ExitStack() as engine:
                calls = (
                    {"engine": engine.enter_context(direct_engine(extractor, config))} if "engine" in targets else {}
                )
                calls |= {d: server_call(client, url, model_id) for d, url in base_urls.items()}
                results += bench_extractor(extractor, calls, settings, pids)
    order = {(e, t, m): i for i, (e, t, m) in enumerate((e, t, m) for e in EXTRACTORS for t in TARGETS for m in MODES)}
    return sorted(results, key=lambda s: order[s.extractor, s.target, s.mode])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = Settings(
        runs=args.runs,
        threads=args.threads,
        wait_idle_secs=args.wait_idle,
        max_foreign_cpu_pct=args.max_foreign_cpu,
        redo=args.runs if args.redo is None else args.redo,
        gliner_head=args.gliner_head,
        gliner_max_width=args.gliner_max_width,
        gliner_rounds=args.gliner_rounds,
        gliner_encoder_layers=args.gliner_encoder_layers,
    )
    targets = [t for t in TARGETS if t in (args.only or TARGETS)]
    extractors = [e for e in EXTRACTORS if e in (args.extractor or EXTRACTORS)]
    load_before = os.getloadavg()
    results = run_targets(targets, extractors, settings)
    rows = summary(results)
    known = {"gliner": known_gliner_spans(settings)} if "gliner" in extractors else {}
    problems, gaps = check_same_spans(results, known)
    for problem in problems[:MAX_LOGGED_DIFFERENCES]:
        log.error("spans differ: %s", problem)
    rounds = ", ".join(f"{e} {settings.rounds(e)}" for e in extractors)
    print(
        f"entity extraction, texts/s: {len(TEXTS)} texts x rounds per pass ({rounds}), labels {LABELS}, "
        f"threshold {THRESHOLD:g}; {settings.runs} passes per series after 1 warm-up; wall time of the pass "
        "(servers: of the HTTP requests)"
    )
    print(machine_line(settings, load_before))
    print(render_table(rows))
    print(spans_line(problems, gaps, known))
    print(conditions_line(rows, settings))
    if args.json:
        write_json(args.json, settings, results, rows, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; every server this run started has been stopped")
        sys.exit(130)
