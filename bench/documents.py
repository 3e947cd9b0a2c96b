"""Document conversion benchmark: pages/s through Hypnos (embedded and distributed) against
docling called directly on the same files, in one run.

- ``docling``: docling's own model-free PDF path, as a user without Hypnos calls it
  (``NativePdfPipeline`` on ``DoclingParseDocumentBackend``, then ``export_to_markdown``; DOCX
  through ``SimplePipeline``), in this process;
- ``engine``: Hypnos's ``DoclingEngine`` (``open_document`` + ``convert_pages``) in this process,
  without any server;
- ``embedded`` / ``distributed``: ``POST /v1/documents/convert`` (multipart), non-streamed and
  streamed, wall time of the HTTP request; ``distributed`` is daphne + ``manage.py runinference``
  + a Celery worker over Redis.

The inputs are built at run time with tests/documents.py (50- and 200-page text PDFs, 4 scanned
pages, a DOCX). One target runs at a time (a server is stopped before the next starts), each file
gets one warm-up then ``--runs`` measured conversions, and the table shows medians and the ratios
to docling and to the engine. bench/README.md describes the method.

    .venv/bin/python bench/documents.py --runs 3
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.chat_stream import (  # noqa: E402
    CpuMeter,
    Proc,
    _stop_on_sigterm,
    redis_server_pids,
    wait_until_quiet,
)
from bench.deployments import running_server  # noqa: E402
from hypnos_site.config import ModelConfig, load_config  # noqa: E402
from tests import documents  # noqa: E402

log = logging.getLogger("bench.documents")

TARGETS = ("docling", "engine", "embedded", "distributed")
SERVERS = ("embedded", "distributed")
MODEL_ID = "docling"
URL = "/v1/documents/convert"
# The target: the server keeps at least this share of direct docling's pages/s on
# multi-page PDFs.
TARGET_RATIO = 0.9
REQUEST_TIMEOUT_SECS = 600.0
SUITE_CONFIG = BASE_DIR / "tests" / "hypnos.test.toml"


@dataclass(frozen=True)
class Document:
    """One input file. `kind` decides how docling reads it: "pdf" (a text layer), "scan" (no
    text layer: only OCR reads it, which docling's model-free pipeline has not) or "docx"."""

    name: str
    path: Path
    pages: int
    kind: str
    mime: str


@dataclass
class Sample:
    """One conversion: the client's wall time and, from a server, its own telemetry."""

    secs: float
    pages: int
    engine_ms_per_page: float | None = None
    job_ms: float | None = None
    idle_before_pct: float | None = None
    foreign_cpu_pct: float | None = None
    disturbed: bool = False

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.secs


@dataclass
class Series:
    """Every conversion of one file by one target (and mode), and their medians."""

    target: str
    document: str
    pages: int
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
    streamed: bool
    database: str


# -- inputs --------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[Path], Document]] = {
    "text-50": lambda d: Document("text-50", documents.long_pdf(d / "text-50.pdf", 50), 50, "pdf", "application/pdf"),
    "text-200": lambda d: Document(
        "text-200", documents.long_pdf(d / "text-200.pdf", 200), 200, "pdf", "application/pdf"
    ),
    "scans-4": lambda d: Document(
        "scans-4", documents.scanned_pages_pdf(d / "scans-4.pdf", 4), 4, "scan", "application/pdf"
    ),
    "docx": lambda d: Document(
        "docx",
        documents.docx_file(d / "plan.docx"),
        1,
        "docx",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ),
}


def build_documents(names: list[str], folder: Path) -> list[Document]:
    """The inputs, written fresh for this run (the repository holds no binary fixtures)."""
    folder.mkdir(parents=True, exist_ok=True)
    return [BUILDERS[name](folder) for name in names]


# -- measuring -----------------------------------------------------------------------------------


def measure(series: Series, settings: Settings, convert: Callable[[], Sample], pids: Callable[[], list[int]]) -> None:
    """One warm-up, then the measured runs. Each waits for a quiet machine; a run during which
    other processes took more than `max_foreign_cpu_pct` of the CPU is measured again, `redo`
    times at most per series (the machine is shared: a test suite next door halves a run)."""
    label = f"{series.target} {series.document}"
    series.warmup = _checked(convert(), series)
    log.info("%s warm-up: %s", label, _describe(series.warmup))
    while len(series.runs) < settings.runs:
        run_label = f"{label} run {len(series.runs) + 1}/{settings.runs}"
        idle = wait_until_quiet(settings.wait_idle_secs, run_label)
        meter = CpuMeter(pids())
        meter.start()
        sample = _checked(convert(), series)
        sample.idle_before_pct, sample.foreign_cpu_pct = idle, meter.foreign_pct()
        sample.disturbed = (sample.foreign_cpu_pct or 0.0) > settings.max_foreign_cpu_pct
        log.info("%s: %s", run_label, _describe(sample))
        if sample.disturbed and len(series.discarded) < settings.redo:
            log.warning(
                "%s: other processes took %.0f%% of the CPU; measuring it again", run_label, sample.foreign_cpu_pct
            )
            series.discarded.append(sample)
            continue
        series.runs.append(sample)


def _checked(sample: Sample, series: Series) -> Sample:
    """A conversion that returned another page count than the file has did not do the work."""
    if sample.pages != series.pages:
        raise RuntimeError(f"{series.target} converted {sample.pages} pages of {series.document}, not {series.pages}")
    return sample


def _describe(sample: Sample) -> str:
    text = f"{sample.pages} pages in {sample.secs * 1000:.0f} ms, {sample.pages_per_s:.1f} pages/s"
    if sample.engine_ms_per_page is not None:
        text += f", engine {sample.engine_ms_per_page:.1f} ms/page"
    if sample.foreign_cpu_pct is not None:
        text += f", others {sample.foreign_cpu_pct:.0f}% CPU"
    return text


def own_pids(procs: list[Proc], with_redis: bool) -> Callable[[], list[int]]:
    """This process (client or engine), the servers and their children (runinference's worker)
    and, distributed, Redis: their CPU is the target's, not a disturbance."""

    def pids() -> list[int]:
        found = [os.getpid()]
        for proc in procs:
            found.append(proc.popen.pid)
            try:
                found += [child.pid for child in psutil.Process(proc.popen.pid).children(recursive=True)]
            except psutil.Error:
                continue
        return found + (redis_server_pids() if with_redis else [])

    return pids


# -- docling directly, and the engine ------------------------------------------------------------


class DirectDocling:
    """docling as its users call it without torch (research/models.md §9b): a pipeline built
    once, then `execute(InputDocument(...))` and `export_to_markdown()` per file."""

    def __init__(self) -> None:
        from docling.datamodel.pipeline_options import ConvertPipelineOptions, NativePdfPipelineOptions
        from docling.pipeline.native_pdf_pipeline import NativePdfPipeline
        from docling.pipeline.simple_pipeline import SimplePipeline

        self.pdf = NativePdfPipeline(NativePdfPipelineOptions())
        self.simple = SimplePipeline(ConvertPipelineOptions())

    def convert(self, doc: Document) -> Sample:
        from docling.backend.docling_parse_backend import DoclingParseDocumentBackend
        from docling.backend.msword_backend import MsWordDocumentBackend
        from docling.datamodel.base_models import InputFormat
        from docling.datamodel.document import InputDocument

        if doc.kind == "docx":
            fmt, backend, pipeline = InputFormat.DOCX, MsWordDocumentBackend, self.simple
        else:
            fmt, backend, pipeline = InputFormat.PDF, DoclingParseDocumentBackend, self.pdf
        started = time.perf_counter()
        result = pipeline.execute(
            InputDocument(path_or_stream=doc.path, format=fmt, backend=backend), raises_on_error=True
        )
        markdown = result.document.export_to_markdown()
        secs = time.perf_counter() - started
        if not markdown.strip():
            raise RuntimeError(f"docling read no text from {doc.name}")
        return Sample(secs=secs, pages=len(result.document.pages) or 1)


def bench_docling(docs: list[Document], settings: Settings) -> list[Series]:
    """docling has no OCR on its model-free path, so the scanned file is left out."""
    docling = DirectDocling()
    results = []
    for doc in docs:
        if doc.kind == "scan":
            continue
        series = Series("docling", doc.name, doc.pages)
        measure(series, settings, lambda d=doc: docling.convert(d), own_pids([], False))
        results.append(series)
    return results


def bench_engine(docs: list[Document], settings: Settings, model: ModelConfig, weights: Path) -> list[Series]:
    """The server's engine without the server: what the HTTP, job and worker layers add is the
    difference to the server rows."""
    from inference.engines.document import DoclingEngine

    engine = DoclingEngine(model, weights, settings.threads)
    engine.load(0, 0)
    try:
        results = []
        for doc in docs:
            series = Series("engine", doc.name, doc.pages)
            measure(series, settings, lambda d=doc: _engine_convert(engine, d), own_pids([], False))
            results.append(series)
        return results
    finally:
        engine.cool()


def _engine_convert(engine: Any, doc: Document) -> Sample:
    """Every page, as the worker's document op drives the engine; ms/page as its telemetry
    measures it (around the page loop)."""
    started = time.perf_counter()
    opened = engine.open_document(doc.path, doc.path.name, 10_000)
    try:
        pages = list(range(1, opened.page_count + 1))
        loop_started = time.perf_counter()
        converted = list(
            engine.convert_pages(
                opened, pages, ocr=True, want_json=False, want_pictures=False, cancel=threading.Event()
            )
        )
        loop_ms = (time.perf_counter() - loop_started) * 1000
    finally:
        engine.close_document(opened)
    secs = time.perf_counter() - started
    return Sample(secs=secs, pages=len(converted), engine_ms_per_page=loop_ms / max(len(converted), 1))


# -- the Hypnos server ---------------------------------------------------------------------------


def write_config(directory: Path, weights: Path, threads: int) -> Path:
    """The one docling model (absolute path to its OCR models) and the benchmark's threads."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "hypnos.toml"
    path.write_text(
        f"""\
[hardware]
n_threads = {threads}

[[models]]
id = "{MODEL_ID}"
modality = "document_conversion"
engine = "docling"
weights_path = {json.dumps(str(weights.resolve()))}
initial_tier = "tier3_nvme_ssd"
"""
    )
    return path


def server_convert(client: httpx.Client, base_url: str, doc: Document, body: bytes, stream: bool) -> Sample:
    """One multipart POST /v1/documents/convert of every page, timed from before the request is
    built to the last byte of the answer."""
    fields = {"model": MODEL_ID, "stream": "true" if stream else "false"}
    files = {"file": (doc.path.name, body, doc.mime)}
    started = time.perf_counter()
    if stream:
        pages, document = _streamed(client, base_url, fields, files)
    else:
        response = client.post(f"{base_url}{URL}", data=fields, files=files)
        if response.status_code != 200:
            raise RuntimeError(f"POST {URL}: {response.status_code} {response.text[:500]}")
        document = response.json()
        pages = len(document["pages"])
    secs = time.perf_counter() - started
    telemetry = document.get("hypnos_telemetry") or {}
    return Sample(
        secs=secs,
        pages=pages,
        engine_ms_per_page=(telemetry.get("engine") or {}).get("ms_per_page"),
        job_ms=telemetry.get("inference_latency_ms"),
    )


def _streamed(
    client: httpx.Client, base_url: str, fields: dict[str, str], files: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The document.page events counted, and the final document event."""
    pages, document = 0, None
    with client.stream("POST", f"{base_url}{URL}", data=fields, files=files) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"POST {URL} (stream): {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("object") == "error":
                raise RuntimeError(f"the stream ended with an error: {event.get('error')}")
            pages += event.get("object") == "document.page"
            document = event if event.get("object") == "document" else document
    if document is None:
        raise RuntimeError("the stream had no final document event")
    return pages, document


def bench_server(
    deployment: str, docs: list[Document], settings: Settings, weights: Path, work_dir: Path
) -> list[Series]:
    """Start the deployment, convert every file (non-streamed, then streamed), stop it."""
    results = []
    config = write_config(work_dir / f"{deployment}-config", weights, settings.threads)
    with running_server(deployment, config, work_dir, settings.database) as server:
        base_url, pids = server.base_url, own_pids(server.procs, deployment == "distributed")
        with httpx.Client(timeout=REQUEST_TIMEOUT_SECS) as client:
            for stream in (False, True) if settings.streamed else (False,):
                target = f"{deployment} stream" if stream else deployment
                for doc in docs:
                    body = doc.path.read_bytes()
                    series = Series(target, doc.name, doc.pages)
                    measure(
                        series,
                        settings,
                        lambda d=doc, b=body, s=stream: server_convert(client, base_url, d, b, s),
                        pids,
                    )
                    results.append(series)
    return results


# -- report --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(results: list[Series], docs: list[Document]) -> list[dict[str, Any]]:
    """One row per file and target: medians, the ratios to docling and to the engine, and the
    check against the target (server rows of multi-page text PDFs only)."""
    kinds = {doc.name: doc for doc in docs}
    base = {(s.target, s.document): s.median("pages_per_s") for s in results}
    rows = []
    for series in results:
        rate = series.median("pages_per_s")
        docling = base.get(("docling", series.document))
        engine = base.get(("engine", series.document))
        vs_docling = rate / docling if rate and docling else None
        doc = kinds[series.document]
        checked = series.target.split()[0] in SERVERS and doc.kind == "pdf" and doc.pages > 1
        rows.append(
            {
                "document": series.document,
                "pages": series.pages,
                "target": series.target,
                "pages_per_s": rate,
                "ratio_vs_docling": vs_docling,
                "ratio_vs_engine": rate / engine if rate and engine else None,
                "meets_target": (vs_docling >= TARGET_RATIO) if checked and vs_docling is not None else None,
                "request_ms_per_page": 1000 / rate if rate else None,
                "job_ms_per_page": _per_page(series.median("job_ms"), series.pages),
                "engine_ms_per_page": series.median("engine_ms_per_page"),
                "runs": len(series.runs),
                "disturbed_runs": sum(s.disturbed for s in series.runs),
                "discarded_runs": len(series.discarded),
            }
        )
    return rows


def _per_page(ms: float | None, pages: int) -> float | None:
    return None if ms is None else ms / pages


def _check(row: dict[str, Any]) -> str:
    if row["meets_target"] is None:
        return "-"
    return "ok" if row["meets_target"] else "BELOW"


def render_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "file",
        "pages",
        "target",
        "pages/s",
        "vs docling",
        f">= {TARGET_RATIO:g}",
        "vs engine",
        "request ms/page",
        "job ms/page",
        "engine ms/page",
    ]
    body = [
        [
            row["document"],
            str(row["pages"]),
            row["target"],
            _fmt(row["pages_per_s"]),
            _fmt(row["ratio_vs_docling"], 2),
            _check(row),
            _fmt(row["ratio_vs_engine"], 2),
            _fmt(row["request_ms_per_page"], 2),
            _fmt(row["job_ms_per_page"], 2),
            _fmt(row["engine_ms_per_page"], 2),
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
    cores = os.cpu_count()
    return (
        f"machine: {cores} cores, shared with other engineers' work (load average "
        f"{load_before[0]:.2f} at the start); docling-slim {version('docling-slim')}, "
        f"docling-parse {version('docling-parse')}; {settings.threads} engine threads; distributed "
        f"database {settings.database}"
    )


def conditions_line(rows: list[dict[str, Any]], settings: Settings) -> str:
    disturbed = sum(row["disturbed_runs"] for row in rows)
    redone = sum(row["discarded_runs"] for row in rows)
    runs = sum(row["runs"] for row in rows)
    return (
        f"runs disturbed by other processes (>{settings.max_foreign_cpu_pct:g}% of the CPU): {disturbed}/{runs} "
        f"kept, {redone} redone"
    )


def write_json(path: Path, settings: Settings, results: list[Series], rows: list[dict[str, Any]]) -> None:
    document = {
        "benchmark": "bench/documents.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": asdict(settings),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "docling_slim": version("docling-slim"),
            "docling_parse": version("docling-parse"),
        },
        "summary": rows,
        "series": [asdict(series) for series in results],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    log.info("wrote %s", path)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="measured conversions per file and target (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads (default: every core)")
    parser.add_argument("--only", action="append", choices=TARGETS, help="run only this target (repeatable)")
    parser.add_argument("--file", action="append", choices=list(BUILDERS), help="convert only this file (repeatable)")
    parser.add_argument("--no-stream", action="store_true", help="server targets: non-streamed requests only")
    parser.add_argument(
        "--database",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="the distributed deployment's database: a SQLite file as chat_stream.py (default), or "
        "PostgreSQL on 127.0.0.1:5432",
    )
    parser.add_argument(
        "--wait-idle", type=float, default=30.0, metavar="SECS", help="wait for a quiet CPU (default 30)"
    )
    parser.add_argument(
        "--max-foreign-cpu", type=float, default=10.0, metavar="PCT", help="redo a run above (default 10)"
    )
    parser.add_argument("--redo", type=int, default=None, metavar="N", help="redone runs per series (default: --runs)")
    parser.add_argument("--json", type=Path, help="also write every run and the summary to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if min(args.runs, args.threads) < 1:
        parser.error("--runs and --threads must be >= 1")
    return args


def run_targets(targets: list[str], names: list[str], settings: Settings) -> tuple[list[Series], list[Document]]:
    """The in-process baselines first (no server runs then), then each deployment in turn; the
    series, and the inputs (their files are gone by then)."""
    suite = load_config({"HYPNOS_CONFIG": str(SUITE_CONFIG)})
    model = next(m for m in suite.models if m.id == MODEL_ID)
    weights = suite.weights_file(model)
    results: list[Series] = []
    with tempfile.TemporaryDirectory(prefix="hypnos-bench-docs-") as tmp:
        docs = build_documents(names, Path(tmp) / "inputs")
        for target in targets:
            if target == "docling":
                results += bench_docling(docs, settings)
            elif target == "engine":
                results += bench_engine(docs, settings, model, weights)
            else:
                results += bench_server(target, docs, settings, weights, Path(tmp))
    return _ordered(results, docs), docs


def _ordered(results: list[Series], docs: list[Document]) -> list[Series]:
    """Rows grouped by file, in the order the files and targets were given."""
    position = {doc.name: i for i, doc in enumerate(docs)}
    return sorted(results, key=lambda s: position[s.document])


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
        streamed=not args.no_stream,
        database=args.database,
    )
    targets = [t for t in TARGETS if t in (args.only or TARGETS)]
    names = [n for n in BUILDERS if n in (args.file or BUILDERS)]
    load_before = os.getloadavg()
    results, docs = run_targets(targets, names, settings)
    rows = summary(results, docs)
    print(
        f"document conversion, pages/s: {settings.runs} runs per file and target after 1 warm-up; "
        f"wall time of the conversion (servers: of the HTTP request, multipart upload included)"
    )
    print(machine_line(settings, load_before))
    print(render_table(rows))
    print(conditions_line(rows, settings))
    if args.json:
        write_json(args.json, settings, results, rows)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log.error("interrupted; every server this run started has been stopped")
        sys.exit(130)
