"""Hypothesis strategies for the route fuzzer: request bodies built from the wire models of
inference/web/openai/protocol.py and inference/web/openai/protocol_media.py (a valid shape first, then mutated), raw
garbage, multipart uploads, odd content types and odd headers.

Generation is kept cheap on purpose: texts are short, token counts tiny and most mutations make
the request a refusal, so a thousand cases run in a few minutes on two cores with real engines.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import math
import re
import struct
import tempfile
import threading
import types
import typing
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st
from pydantic import BaseModel

# -- what the generated requests name --------------------------------------------------------

ADMIN_KEY = "sk-fuzz-admin"
USER_KEY = "sk-fuzz-user"
VICTIM = "fuzz-victim"  # a copy of SmolLM2 the pool-changing routes may disable, replace or delete
CHAT, EMBED, STT, TTS, DOCLING = "smollm2-135m", "all-minilm-l6-v2", "whisper-tiny.en", "piper-joe", "docling"
# A GLiNER-shaped graph with known scores (tests/gliner_graph.py), built for the fuzz run.
ENTITIES = "fuzz-gliner"
# The image models of the suite's lineup, when it has them.
IMAGE_MODELS = ("dcgan-faces", "realesrgan-x4")
SERVED = (CHAT, EMBED, STT, TTS, DOCLING, VICTIM)
ALIASES = ("gpt-4o-mini", "text-embedding-3-small", "whisper-1", "tts-1")

SHORT_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
WORDS = st.sampled_from(["Hi", "Hello there.", "Say yes.", "Paris?", "one two", "OK"])
model_names = st.one_of(
    st.sampled_from(SERVED + ALIASES),
    st.sampled_from(["", "nope", "SMOLLM2-135M", "smollm2-135m ", "../etc/passwd", "a" * 300]),
    SHORT_TEXT,
)


# -- media ------------------------------------------------------------------------------------


def _wav(seconds: float = 0.3, rate: int = 16000, tone: bool = True) -> bytes:
    frames = int(seconds * rate)
    samples = [int(8000 * math.sin(2 * math.pi * 440 * i / rate)) if tone else 0 for i in range(frames)]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(struct.pack(f"<{frames}h", *samples))
    return out.getvalue()


def _png(width: int = 2, height: int = 2) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, "PNG")
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels (a decompression bomb's shape)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


WAV = _wav()
PNG = _png()
# A RIFF header that claims a 4 GB data chunk and a 4 GHz rate over a few real bytes.
WAV_CLAIMING_HUGE = (
    b"RIFF"
    + struct.pack("<I", 0xFFFFFFF0)
    + b"WAVEfmt "
    + struct.pack("<IHHIIHH", 16, 1, 1, 4_000_000_000, 4_000_000_000, 2, 16)
    + b"data"
    + struct.pack("<I", 0xFFFFFFF0)
    + b"\0" * 64
)

audio_bytes = st.one_of(
    st.just(WAV),
    st.just(_wav(0.2, tone=False)),
    st.just(WAV[:44]),
    st.just(WAV[: len(WAV) // 2]),
    st.just(WAV_CLAIMING_HUGE),
    st.just(b""),
    st.just(b"ID3\x04\0\0\0\0\0\0" + b"\xff\xfb" * 20),
    st.binary(max_size=64),
    st.builds(lambda b: WAV[:44] + b, st.binary(max_size=200)),
)
image_bytes = st.one_of(
    st.just(PNG),
    st.just(PNG[:20]),
    st.just(png_claiming(60000, 60000)),
    st.just(b"GIF89a"),
    st.binary(max_size=64),
)


image_sizes = st.sampled_from(["64x64", "256x256", "auto", "0x0", "64", "axb", "1000x700", "9999999x2", "x"])


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# Hosts that need no DNS (this machine has no resolver to the outside), private and public.
URL_HOSTS = [
    "127.0.0.1",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "10.1.2.3",
    "169.254.169.254",
    "0.0.0.0",
    "localhost",
    "[fe80::1%25lo]",
    "[::]",
    "8.8.8.8:1",
    "[2001:db8::1]",
    "256.1.1.1",
    "[::1",
    "",
]
image_urls = st.one_of(
    st.builds(_data_url, st.sampled_from(["image/png", "image/jpeg", "text/plain", ""]), image_bytes),
    st.sampled_from(
        [
            "data:",
            "data:image/png;base64,!!!",
            "data:image/png,raw",
            "ftp://x/y.png",
            "file:///etc/passwd",
            "",
            "not a url",
        ]
    ),
    st.builds(
        lambda scheme, host, path: f"{scheme}://{host}/{path}",
        st.sampled_from(["http", "https", "HTTP"]),
        st.sampled_from(URL_HOSTS),
        st.sampled_from(["a.png", "", "%00", "x" * 50]),
    ),
)
input_audio_data = st.one_of(
    st.builds(lambda b: base64.b64encode(b).decode(), audio_bytes), st.sampled_from(["", "!!!!", "AAAA", "=" * 9])
)


# -- documents ----------------------------------------------------------------------------------

# The fuzz config's document limits (fuzz_config): a few pages and a few tens of KB keep every
# conversion in the run cheap, and the documents below sit on both sides of each limit.
MAX_DOCUMENT_BYTES = 48 << 10
MAX_DOCUMENT_PAGES = 3


def _documents() -> dict[str, bytes]:
    """Real documents, built once (tests/documents.py) and kept as bytes: a temporary folder is
    all the builders need, and nothing is left behind."""
    from tests import documents

    with tempfile.TemporaryDirectory() as folder:
        here = Path(folder)
        return {
            "pdf": documents.long_pdf(here / "two.pdf", 2).read_bytes(),
            "pictures_pdf": documents.multipage_pdf(here / "report.pdf").read_bytes(),
            "too_many_pages": documents.long_pdf(here / "five.pdf", MAX_DOCUMENT_PAGES + 2).read_bytes(),
            "docx": documents.docx_file(here / "plan.docx").read_bytes(),
            "html": documents.html_file(here / "page.html").read_bytes(),
            "encrypted": documents.encrypted_pdf(here / "locked.pdf").read_bytes(),
        }


DOCUMENTS = _documents()
document_bytes = st.one_of(
    st.sampled_from(
        [
            DOCUMENTS["pdf"],
            DOCUMENTS["pictures_pdf"],
            DOCUMENTS["pictures_pdf"],
            DOCUMENTS["pictures_pdf"],
            DOCUMENTS["html"],
            DOCUMENTS["docx"],
            DOCUMENTS["too_many_pages"],
            DOCUMENTS["encrypted"],
            DOCUMENTS["pdf"][: len(DOCUMENTS["pdf"]) // 2],  # truncated: no %%EOF
            DOCUMENTS["pdf"][:400] + b"%%EOF",  # cut, with an end marker
            DOCUMENTS["docx"][:2000],  # a zip without its directory
            PNG,
            b"# Title\n\nSome *markdown*.\n",
            b"a,b\n1,2\n",
            b"",
            b"%PDF-",
            b"%PDF-1.7\n%%EOF",
            b"PK\x03\x04" + b"\0" * 26,
            b"\xff\xfe\x00\x00",
            b"%PDF-" + b"\0" * MAX_DOCUMENT_BYTES,  # just over the size limit
        ]
    ),
    st.binary(max_size=64),
)
document_files = st.one_of(
    document_bytes.map(lambda data: base64.b64encode(data).decode()),
    document_bytes.map(lambda data: base64.b64encode(data).decode()),
    st.builds(
        _data_url, st.sampled_from(["application/pdf", "text/html", "", "application/octet-stream"]), document_bytes
    ),
    st.sampled_from(
        [
            "",
            "!!!!",
            "AAA",
            "data:",
            "data:application/pdf,%PDF-1.7",
            "data:application/pdf;base64,",
            "data:;base64,JVBERi0=",
            "data:application/pdf;base64,!!!",
            base64.urlsafe_b64encode(b"\xfb\xff" * 8).decode(),
            base64.b64encode(DOCUMENTS["pdf"]).decode()[:-3],
        ]
    ),
)


class FetchTrap:
    """An HTTP server on loopback that serves the PDF and counts the requests it gets: a
    document URL on a private address must be refused before anything connects, so any hit is
    a finding. Started on first use (it needs a port before the URLs can name it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._hits: list[str] = []

    @property
    def port(self) -> int:
        with self._lock:
            if self._server is None:
                self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
                threading.Thread(
                    target=self._server.serve_forever,
                    kwargs={"poll_interval": 0.05},
                    name="fuzz-fetch-trap",
                    daemon=True,
                ).start()
            return int(self._server.server_address[1])

    def take(self) -> list[str]:
        """The paths requested since the last call."""
        with self._lock:
            hits, self._hits = self._hits, []
        return hits

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        trap = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with trap._lock:
                    trap._hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/pdf")
                self.send_header("Content-Length", str(len(DOCUMENTS["pdf"])))
                self.end_headers()
                self.wfile.write(DOCUMENTS["pdf"])

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


FETCH_TRAP = FetchTrap()
# Every address here is loopback, private, link-local, metadata or unspecified, or the URL is
# malformed: all of them must be refused with a 400 (spec §12: the image URL rules).
PRIVATE_URL_HOSTS = [h for h in URL_HOSTS if h not in ("8.8.8.8:1", "")] + [
    "127.1",
    "2130706433",
    "0x7f.0.0.1",
    "[::ffff:7f00:1]",
    "[64:ff9b::7f00:1]",
    "100.64.0.1",
    "192.168.0.1:99999",
    "127.0.0.1:x",
    "user:pass@127.0.0.1",
]
document_urls = st.one_of(
    st.builds(
        lambda scheme, host, path: f"{scheme}://{host}/{path}",
        st.sampled_from(["http", "https", "HTTP"]),
        st.sampled_from(PRIVATE_URL_HOSTS),
        st.sampled_from(["report.pdf", "", "%00", "latest/meta-data/", "a/../b.pdf"]),
    ),
    st.builds(
        lambda host, path: f"http://{host}:{FETCH_TRAP.port}/{path}",
        st.sampled_from(["127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0"]),
        st.sampled_from(["report.pdf", "x"]),
    ),
    st.sampled_from(
        [
            "file:///etc/passwd",
            "ftp://127.0.0.1/x.pdf",
            "gopher://127.0.0.1:70/",
            "javascript:alert(1)",
            "data:application/pdf;base64,JVBERi0=",
            "//127.0.0.1/x.pdf",
            "http:///x.pdf",
            "http://",
            "not a url",
            "",
            "http://[::1/x.pdf",
            "http://\x00/x.pdf",
            "http://" + "a" * 300 + "/x.pdf",
        ]
    ),
)
document_names = st.sampled_from(
    ["report.pdf", "page.html", "notes.md", "plan.docx", "noext", ".pdf", "x.PDF", "\u00e9t\u00e9.pdf", "a" * 300]
)
document_pages = st.sampled_from(["1", "2", "1-2", "2-1", "0", "99", "x", "", " 1 ", "-1", "1-", "-", "1-99", "9" * 32])
# Vision models for describe_pictures: the fuzz lineup has none, so each names something else.
describe_models = st.sampled_from([CHAT, "nope", "", DOCLING, STT, "gpt-4o-mini"])


@st.composite
def document_source(draw: st.DrawFn, fields: dict[str, Any]) -> dict[str, Any]:
    """A convert body's fields with its document: mostly `file` holding a real document, then a
    URL (never to be fetched), both or neither, or the wire model's own random draw."""
    kind = draw(st.sampled_from(["file"] * 7 + ["url", "url", "both", "neither", "drawn"]))
    if kind == "drawn":
        return fields
    rest = {k: v for k, v in fields.items() if k not in ("file", "url")}
    if kind in ("file", "both"):
        rest["file"] = draw(document_files)
    if kind in ("url", "both"):
        rest["url"] = draw(document_urls)
    return rest


# -- JSON schemas (response_format, tools, text.format) ---------------------------------------

# Schema bounds: mostly small, plus the sizes that crashed libllama's grammar sampler (above its
# 1000-repetition ceiling) or grew the converter's memory without bound before the schema limits
# (inference/web/common/grammar_limits.py) refused them; those must now be 400s.
SCHEMA_BOUND_LIMIT = 100
SCHEMA_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_bound = st.one_of(
    st.integers(0, SCHEMA_BOUND_LIMIT), st.sampled_from([1000, 1001, 2000, 5000, 10_000_000, 30_000_000, 1_000_000_000])
)


def _schema_leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("string")},
            optional={
                "minLength": _bound,
                "maxLength": _bound,
                "enum": st.lists(WORDS, max_size=3),
                "pattern": st.sampled_from(["^a+$", "[", ".*"]),
                "format": st.sampled_from(["date", "email"]),
            },
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["integer", "number"])},
            optional={"minimum": st.integers(-10, 10), "maximum": st.integers(-10, 10)},
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null", "nope", ""])}),
        st.fixed_dictionaries({"const": st.one_of(st.integers(-3, 3), WORDS)}),
        st.just({}),
        st.just({"$ref": "#/$defs/missing"}),
    )


def _schema_node(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.sampled_from(["a", "b", "name", "city", "", "x y", "\u00e9"])
    return st.one_of(
        st.builds(
            lambda props, req: {"type": "object", "properties": props, "required": req},
            st.dictionaries(names, children, max_size=3),
            st.lists(names, max_size=2),
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": children}, optional={"minItems": _bound, "maxItems": _bound}
        ),
        st.builds(lambda opts: {"anyOf": opts}, st.lists(children, max_size=3)),
        st.builds(lambda opts: {"oneOf": opts}, st.lists(children, min_size=1, max_size=2)),
    )


json_schemas = st.recursive(_schema_leaf(), _schema_node, max_leaves=6)


# -- bodies from the wire models ----------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-5, 5), SHORT_TEXT)
small_json = st.recursive(
    JSON_SCALARS, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(SHORT_TEXT, c, max_size=3)), max_leaves=5
)

content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": image_urls}, optional={"detail": st.sampled_from(["auto", "low"])}
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {"data": input_audio_data}, optional={"format": st.sampled_from(["wav", "mp3", "x"])}
            ),
        }
    ),
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.sampled_from(["call_1", "OK"]),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.just("get_weather"), "arguments": st.sampled_from(['{"city": "Paris"}', "{", ""])}
            ),
        }
    ),
    max_size=1,
)
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
        optional={
            "content": st.one_of(WORDS, st.none(), st.lists(content_parts, max_size=2)),
            "name": WORDS,
            "tool_call_id": WORDS,
            "tool_calls": tool_calls,
        },
    ),
    min_size=1,
    max_size=3,
)
responses_items = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "developer"]),
                "content": st.one_of(
                    WORDS,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": WORDS}
                        ),
                        max_size=2,
                    ),
                ),
            }
        ),
        st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"), "content": WORDS}),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": WORDS,
                "name": st.just("get_weather"),
                "arguments": st.sampled_from(['{"city": "Paris"}', "{"]),
            }
        ),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": WORDS, "output": WORDS}),
        small_json,
    ),
    min_size=1,
    max_size=3,
)

# Sentences the fuzz entity model scores (tests/gliner_graph.py), one with emoji before it.
ENTITY_TEXTS = (
    "Mario Rossi works in Milan for Ferrari.",
    "Tim Cook announced the iPhone 17 in Cupertino.",
    "\U0001f389 Anna opened an account at the Bank of Milan.",
    "",
)
ENTITY_LABELS = ("person", "city", "company", "product", "date", "country", "sport", "organisation", "person ")

# Field values that keep a valid body cheap to serve (tiny token counts, short texts, served
# models); every other field is drawn from its annotation and constraints.
FIELD_OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "model": model_names,
    "messages": chat_messages,
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "max_output_tokens": st.integers(1, 3),
    "num_ctx": st.sampled_from([1, 256, 2048, 4096, 9000]),
    "ctx_size": st.sampled_from([1, 256, 2048]),
    "context_len": st.sampled_from([256, 2048, 4096, 9000]),
    "top_logprobs": st.integers(0, 3),
    "seed": st.integers(0, 2**31),
    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=5)),
    "parameters": json_schemas,
    "schema_": json_schemas,
    "prompt": st.one_of(WORDS, st.lists(WORDS, max_size=2)),
    "input": st.one_of(WORDS, st.lists(WORDS, max_size=3)),
    "instructions": WORDS,
    "voice": st.sampled_from(["alloy", "echo", "nova", "onyx", "shimmer", "joe", "nope", ""]),
    "language": st.sampled_from(["en", "de", "", "english", "xx-YY"]),
    "max_bytes": st.sampled_from([0, 1, 1 << 20, 1 << 40]),
    "max_loaded_models": st.integers(1, 4),
    "vram_bytes": st.sampled_from([0, 4 << 30, 24 << 30]),
    "ram_bytes": st.sampled_from([1, 16 << 30]),
    "mode": st.sampled_from(["off", "auto", "on", "maybe", ""]),
}
# Per-model refinements of the overrides above (keyed "<Model>.<field>").
MODEL_FIELD_OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "ResponsesRequest.input": st.one_of(WORDS, responses_items),
    "SpeechRequest.input": WORDS,
    # OpenAI's four shapes: texts, and token ids (all-MiniLM's vocabulary is 30522 ids: some
    # drawn here are outside it, and some are negative), plus empty and mixed arrays.
    "EmbeddingRequest.input": st.one_of(
        WORDS,
        st.lists(WORDS, max_size=3),
        st.lists(st.integers(-1, 30600), max_size=6),
        st.lists(st.lists(st.integers(0, 30600), max_size=6), max_size=3),
        st.just(""),
        st.just([]),
        st.just([[]]),
        st.sampled_from([["Hi", 101], [101, "Hi"], [[101, 102], "Hi"], [[101, "Hi"]], [101.0], [True]]),
    ),
    "DocumentConvertRequest.model": st.sampled_from([DOCLING] * 8 + [CHAT, EMBED, "nope", ""]),
    "EntityRequest.model": st.sampled_from([ENTITIES] * 8 + [CHAT, EMBED, "nope", ""]),
    "ImageGenerationRequest.model": st.sampled_from([*IMAGE_MODELS] * 4 + [CHAT, "nope", ""]),
    "ImageGenerationRequest.prompt": WORDS,
    "ImageGenerationRequest.n": st.integers(0, 6),
    "ImageGenerationRequest.size": image_sizes,
    "ImageGenerationRequest.steps": st.sampled_from([1, 2, 0, -5, 1000]),
    "ImageUpscaleRequest.model": st.sampled_from([*IMAGE_MODELS] * 4 + [CHAT, "nope", ""]),
    "ImageUpscaleRequest.image": st.one_of(
        st.builds(lambda b: base64.b64encode(b).decode(), image_bytes),
        st.builds(_data_url, st.sampled_from(["image/png", "text/plain"]), image_bytes),
        st.sampled_from(["!!!", "", "data:image/png,raw"]),
    ),
    "ImageUpscaleRequest.upscale_factor": st.sampled_from([2, 4, 3, 0, 8, -1]),
    "EntityRequest.input": st.one_of(
        st.sampled_from(ENTITY_TEXTS), st.lists(st.sampled_from(ENTITY_TEXTS), max_size=4), SHORT_TEXT
    ),
    "EntityRequest.labels": st.one_of(
        st.lists(st.sampled_from(ENTITY_LABELS), max_size=12),
        st.lists(SHORT_TEXT, max_size=3),
        st.just(["x" * 101]),
    ),
    "DocumentConvertRequest.filename": document_names,
    "DocumentConvertRequest.pages": document_pages,
    "DocumentConvertRequest.describe_pictures": describe_models,
    # Mostly kept, so the picture routes find stored pictures (SEEN_DOCUMENTS).
    "DocumentConvertRequest.return_pictures": st.sampled_from([True, True, True, False]),
    "DocumentConvertRequest.url": document_urls,
    "ResponsesRequest.tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]), st.just({"type": "function", "name": "get_weather"}), small_json
    ),
}


def _bounds(metadata: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in metadata:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            value = getattr(item, name, None)
            if value is not None:
                found[name] = value
    return found


def for_annotation(annotation: Any, metadata: list[Any] | None = None) -> st.SearchStrategy[Any]:
    """A strategy of valid JSON values for a pydantic field annotation and its constraints."""
    bounds = _bounds(metadata or [])
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        return for_annotation(inner, [*(metadata or []), *extra])
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return st.one_of([for_annotation(arg, metadata) for arg in typing.get_args(annotation)])
    if origin is list:
        (item,) = typing.get_args(annotation)
        return st.lists(for_annotation(item), min_size=bounds.get("min_length", 0), max_size=3)
    if origin is dict or annotation is dict:
        return st.dictionaries(SHORT_TEXT, small_json, max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = bounds.get("ge", bounds["gt"] + 1 if "gt" in bounds else -5)
        return st.integers(low, bounds.get("le", bounds["lt"] - 1 if "lt" in bounds else low + 100))
    if annotation is float:
        low = bounds.get("ge", bounds.get("gt", -5.0))
        return st.floats(
            low,
            bounds.get("le", bounds.get("lt", low + 10.0)),
            exclude_min="gt" in bounds,
            exclude_max="lt" in bounds,
            allow_nan=False,
        )
    if annotation is str:
        if "pattern" in bounds:
            return st.from_regex(bounds["pattern"], fullmatch=True).filter(
                lambda s: bounds.get("min_length", 0) <= len(s) <= bounds.get("max_length", 10**6)
            )
        return st.text(
            st.characters(codec="utf-8", exclude_categories=("Cs",)),
            min_size=bounds.get("min_length", 0),
            max_size=min(bounds.get("max_length", 12), 12),
        )
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return wire_body(annotation)
    return small_json  # Any


def wire_body(
    model: type[BaseModel], overrides: dict[str, st.SearchStrategy[Any]] | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body of `model`: every required field, a random subset of the optional ones, keys
    spelled as on the wire (aliases). `overrides` ("<Model>.<field>") come before the module's."""
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for name, field in model.model_fields.items():
        key = f"{model.__name__}.{name}"
        strategy = (overrides or {}).get(key, MODEL_FIELD_OVERRIDES.get(key))
        if strategy is None:
            strategy = FIELD_OVERRIDES.get(name)
        if strategy is None:
            strategy = for_annotation(field.annotation, list(field.metadata))
        (required if field.is_required() else optional)[field.alias or name] = strategy
    return st.fixed_dictionaries(required, optional=optional)


# -- mutations ------------------------------------------------------------------------------------

LONE_SURROGATES = ("\ud800", "\udfff", "a\udc00b")
NASTY_STRINGS = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "\n\r\t",
    "\u202e\u0301",
    "\U0001f600" * 3,
    "\ufeff",
    "\uffff",
    "null",
    "1e999",
    "-1",
    "<__media__>",
    "{{",
    "%s%n",
    "\\u0000",
    *LONE_SURROGATES,
)
NASTY_NUMBERS = (
    0,
    -1,
    2**31,
    2**63,
    -(2**63) - 1,
    10**30,
    -(10**30),
    10**400,
    1e308,
    -1e308,
    5e-324,
    -0.0,
    0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
)
nasty_values = st.one_of(
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(NASTY_NUMBERS),
    st.sampled_from([None, True, False]),
    st.sampled_from([[], {}, [[]], {"": None}, [None], {"type": None}]),
    st.text(max_size=8),  # any code point, lone surrogates included
    st.integers(),
    st.floats(),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


def _delete(value: Any, path: tuple[Any, ...]) -> Any:
    if len(path) == 1:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k != path[0]}
        return [v for i, v in enumerate(value) if i != path[0]]
    head = path[0]
    if isinstance(value, dict):
        return {**value, head: _delete(value[head], path[1:])}
    copy = list(value)
    copy[head] = _delete(copy[head], path[1:])
    return copy


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


@dataclass(frozen=True)
class Deep:
    """`leaf` inside `depth` arrays or objects; written out by encode_json (json.dumps itself
    recurses, so it cannot write a value deeper than Python's recursion limit)."""

    depth: int
    kind: str
    leaf: Any

    def text(self) -> str:
        inner = encode_json(self.leaf, "plain").decode("utf-8", "surrogatepass")
        if self.kind == "list":
            return "[" * self.depth + inner + "]" * self.depth
        return '{"a":' * self.depth + inner + "}" * self.depth


def has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    if isinstance(value, Deep):
        return has_lone_surrogate(value.leaf)
    return False


def max_depth(value: Any) -> int:
    """How deeply arrays and objects nest in a body (a Deep counts its levels)."""
    if isinstance(value, Deep):
        return value.depth + max_depth(value.leaf)
    if isinstance(value, dict):
        return 1 + max((max_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((max_depth(v) for v in value), default=0)
    return 0


@st.composite
def mutated(draw: st.DrawFn, body: Any, max_mutations: int = 3) -> Any:
    """`body` with 0..max_mutations changes: a value replaced by a wrong type, a nasty string or
    number, a huge string, deep nesting; a field deleted; an extra field added."""
    for _ in range(draw(st.integers(0, max_mutations))):
        path = draw(st.sampled_from(_paths(body)))
        target = _get(body, path)
        op = draw(st.sampled_from(["replace", "replace", "delete", "extra", "huge", "nest", "unicode"]))
        if op == "replace":
            body = _replace(body, path, draw(nasty_values))
        elif op == "delete" and path:
            body = _delete(body, path)
        elif op == "extra" and isinstance(target, dict):
            body = _replace(
                body,
                path,
                {**target, draw(st.sampled_from(["extra", "", "\x00", "model", "__proto__"])): draw(nasty_values)},
            )
        elif op == "huge":
            size = draw(st.sampled_from([401, 5000, 70000]))
            body = _replace(body, path, draw(st.sampled_from(["x", "\u00e9", "\U0001f600 "])) * size)
        elif op == "nest":
            depth = draw(st.sampled_from([2, 30, 200, 5000]))
            body = _replace(body, path, Deep(depth, draw(st.sampled_from(["list", "dict"])), target))
        elif op == "unicode" and isinstance(target, str):
            body = _replace(body, path, target + draw(st.sampled_from(NASTY_STRINGS)))
    return body


# -- encodings, content types, headers ---------------------------------------------------------------


def encode_json(value: Any, flavour: str) -> bytes:
    """The body on the wire: plain JSON (NaN and Infinity as Python writes them), raw UTF-8 with
    any lone surrogate written as is (invalid UTF-8), with a BOM, truncated or with trailing junk."""
    deep: list[Deep] = []

    def placeholder(item: Any) -> str:
        if not isinstance(item, Deep):
            raise TypeError(f"not JSON: {item!r}")
        deep.append(item)
        return f"__deep_{len(deep) - 1}__"

    text = json.dumps(value, ensure_ascii=flavour != "raw_utf8", default=placeholder)
    for index, item in enumerate(deep):
        text = text.replace(f'"__deep_{index}__"', item.text(), 1)
    data = text.encode("utf-8", "surrogatepass")
    if flavour == "bom":
        return b"\xef\xbb\xbf" + data
    if flavour == "truncated":
        return data[: max(len(data) // 2, 1)]
    if flavour == "trailing":
        return data + b"}{"
    if flavour == "latin1":
        return text.encode("latin-1", "replace")
    return data


JSON_FLAVOURS = st.sampled_from(["plain"] * 10 + ["raw_utf8", "bom", "truncated", "trailing", "latin1"])
JSON_TYPES = st.sampled_from(
    ["application/json"] * 12
    + [
        "application/json; charset=utf-8",
        "application/json; charset=latin-1",
        "application/json; charset=utf-16",
        "APPLICATION/JSON",
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/xml",
        "",
        "multipart/form-data",
        "multipart/form-data; boundary=",
        "application/octet-stream",
        "application/json;;;",
        "\x7f/\x7f",
    ]
)
garbage_bodies = st.one_of(
    st.binary(max_size=256),
    st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"1",
            b'"x"',
            b"{",
            b"{}",
            b'{"a":1,"a":2}',
            b"NaN",
            b"\xff\xfe{\x00}\x00",
            b"[" * 5000,
            b'{"a":' * 5000,
            b"\x00" * 64,
            b'{"model": "\\ud800"}',
        ]
    ),
)


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "fuzzBoundary123") -> bytes:
    """A multipart/form-data body: (name, filename or None, value) parts."""
    out = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode("utf-8", "surrogatepass")
        if filename is not None:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@st.composite
def transcription_upload(draw: st.DrawFn) -> tuple[bytes, str]:
    """A multipart transcription upload (what the SDKs send), mutated: no file part, no
    filename, odd fields, a wrong or missing boundary, a truncated body."""
    fields = draw(
        mutated(
            draw(
                st.fixed_dictionaries(
                    {"model": model_names},
                    optional={
                        "language": FIELD_OVERRIDES["language"],
                        "prompt": WORDS,
                        "temperature": st.sampled_from(["0", "0.5", "2", "-1", "hot", "nan", "1e999"]),
                        "response_format": st.sampled_from(["json", "text", "verbose_json", "srt", "vtt", "xml", ""]),
                        "timestamp_granularities[]": st.sampled_from(["word", "segment", "char"]),
                    },
                )
            ),
            max_mutations=1,
        )
    )
    parts = [
        (str(k), None, v.encode("utf-8", "surrogatepass") if isinstance(v, str) else encode_json(v, "plain"))
        for k, v in (fields.items() if isinstance(fields, dict) else [])
    ]
    if draw(st.integers(0, 9)):
        parts.append(
            ("file", draw(st.sampled_from(["speech.wav", "", "a\x00.wav", "../x.mp3", None])), draw(audio_bytes))
        )
    parts = draw(st.permutations(parts))
    body = multipart(parts)
    shape = draw(st.sampled_from(["ok"] * 8 + ["no_boundary", "wrong_boundary", "truncated", "empty"]))
    content_type = "multipart/form-data; boundary=fuzzBoundary123"
    if shape == "no_boundary":
        content_type = "multipart/form-data"
    elif shape == "wrong_boundary":
        content_type = "multipart/form-data; boundary=other"
    elif shape == "truncated":
        body = body[: len(body) // 2]
    elif shape == "empty":
        body = b""
    return body, content_type


HEADER_VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "-1",
            "1e309",
            "abc",
            "999999999999999999999",
            "nan",
            "true",
            "x" * 8000,
            "smollm2-135m",
            "piper-joe",
            "voice/1",
            "\t",
        ]
    ),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16),
)
AUTHORIZATIONS = st.sampled_from(
    [f"Bearer {ADMIN_KEY}"] * 40
    + [
        None,
        f"bearer   {ADMIN_KEY} ",
        f"Bearer {USER_KEY}",
        f"Bearer {USER_KEY}",
        "",
        "Bearer",
        "Bearer ",
        "Basic YTpi",
        "Bearer sk-wrong",
        f"Token {ADMIN_KEY}",
        f"Bearer {ADMIN_KEY}\x00",
        "Bearer " + "k" * 4000,
    ]
)
ODD_HEADERS = [
    "x-hypnos-deadline-ms",
    "x-hypnos-next-model",
    "x-hypnos-workflow",
    "x-hypnos-workflow-end",
    "accept",
    "accept-encoding",
    "content-encoding",
    "origin",
    "x-request-id",
    "range",
    "expect",
    "x-forwarded-for",
    "cookie",
    "access-control-request-method",
]


@st.composite
def headers(draw: st.DrawFn) -> dict[str, str]:
    """Mostly the admin key and nothing odd; sometimes a bad key and a few odd headers."""
    found: dict[str, str] = {}
    authorization = draw(AUTHORIZATIONS)
    if authorization is not None:
        found["authorization"] = authorization
    odd = draw(st.sampled_from([0] * 6 + [1, 1, 2, 3]))
    for name in draw(st.lists(st.sampled_from(ODD_HEADERS), min_size=odd, max_size=odd, unique=True)):
        found[name] = draw(HEADER_VALUES)
    return found


def path_segment(raw: str) -> str:
    return quote(raw.encode("utf-8", "surrogatepass"), safe="")


path_ids = st.one_of(
    st.sampled_from(SERVED + ALIASES),
    st.sampled_from(["nope", "%00", "%ff", "..", "a/b", "x" * 300]),
    SHORT_TEXT.filter(bool).map(path_segment),
)
query_strings = st.one_of(
    st.just(""),
    st.builds(
        lambda k, v: f"?{k}={v}",
        st.sampled_from(["modality", "limit", "status", "model", "route", "key", "drain_secs", "x", ""]),
        st.sampled_from(
            ["", "1", "-1", "abc", "1e309", "nan", "%00", "%ff", "text_generation", "5xx", "x" * 500, "120", "3601"]
        ),
    ),
    st.sampled_from(["?", "?&&", "?a=1&a=2", "?%zz", "?limit"]),
)


# -- the document routes' uploads and ids --------------------------------------------------------


@st.composite
def document_upload(draw: st.DrawFn) -> tuple[bytes, str]:
    """A multipart convert upload, mutated like transcription_upload: the file part with an
    odd name or none, form booleans that are no booleans, a URL part beside it or instead."""
    form_bools = st.sampled_from(["true", "false", "1", "0", "yes", "no", "on", "off", "TRUE", " yes ", "maybe", ""])
    fields = draw(
        mutated(
            draw(
                st.fixed_dictionaries(
                    {"model": st.sampled_from([DOCLING] * 6 + [CHAT, "nope", ""])},
                    optional={
                        "pages": document_pages,
                        "ocr": form_bools,
                        "stream": form_bools,
                        "return_pictures": st.one_of(st.sampled_from(["true", "yes", "1"]), form_bools),
                        "output_format": st.sampled_from(["markdown", "json", "html", ""]),
                        "filename": document_names,
                        "describe_pictures": describe_models,
                        "url": document_urls,
                    },
                )
            ),
            max_mutations=1,
        )
    )
    parts = [
        (str(k), None, v.encode("utf-8", "surrogatepass") if isinstance(v, str) else encode_json(v, "plain"))
        for k, v in (fields.items() if isinstance(fields, dict) else [])
    ]
    if draw(st.integers(0, 9)):
        name = draw(st.sampled_from(["report.pdf", "report.pdf", "", "a\x00.pdf", "../x.pdf", "..", "x/y.docx", None]))
        parts.append(("file", name, draw(document_bytes)))
    if not draw(st.integers(0, 9)):
        parts.append(("file", None, base64.b64encode(DOCUMENTS["pdf"])))  # a text part named file
    body = multipart(draw(st.permutations(parts)))
    shape = draw(st.sampled_from(["ok"] * 8 + ["no_boundary", "wrong_boundary", "truncated", "empty"]))
    content_type = "multipart/form-data; boundary=fuzzBoundary123"
    if shape == "no_boundary":
        content_type = "multipart/form-data"
    elif shape == "wrong_boundary":
        content_type = "multipart/form-data; boundary=other"
    elif shape == "truncated":
        body = body[: len(body) // 2]
    elif shape == "empty":
        body = b""
    return body, content_type


@st.composite
def image_upload(draw: st.DrawFn) -> tuple[bytes, str]:
    """A multipart edit or variation (what the SDKs send), mutated like document_upload: the
    image part as `image` or `image[]`, not an image, a bomb, truncated; a mask part; numbers
    that are no numbers."""
    fields = draw(
        mutated(
            draw(
                st.fixed_dictionaries(
                    {"model": st.sampled_from([*IMAGE_MODELS] * 3 + [CHAT, "nope", ""])},
                    optional={
                        "prompt": WORDS,
                        "n": st.sampled_from(["1", "2", "0", "9", "two", ""]),
                        "size": image_sizes,
                        "seed": st.sampled_from(["7", "-1", "1e9", "x"]),
                        "cfg_scale": st.sampled_from(["1.5", "nan", "inf", "-2"]),
                        "response_format": st.sampled_from(["b64_json", "url", "png"]),
                    },
                )
            ),
            max_mutations=1,
        )
    )
    parts = [
        (str(k), None, v.encode("utf-8", "surrogatepass") if isinstance(v, str) else encode_json(v, "plain"))
        for k, v in (fields.items() if isinstance(fields, dict) else [])
    ]
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
        parts.append((draw(st.sampled_from(["image", "image", "image[]"])), "ref.png", draw(image_bytes)))
    if not draw(st.integers(0, 9)):
        parts.append(("mask", "mask.png", PNG))
    body = multipart(draw(st.permutations(parts)))
    shape = draw(st.sampled_from(["ok"] * 8 + ["no_boundary", "truncated"]))
    content_type = "multipart/form-data; boundary=fuzzBoundary123"
    if shape == "no_boundary":
        content_type = "multipart/form-data"
    elif shape == "truncated":
        body = body[: len(body) // 2]
    return body, content_type


# The ids of the picture-store documents the fuzzed conversions made (return_pictures), noted
# from their successful answers (an error message may echo a made-up id), so the picture routes
# also reach documents that exist.
DOCUMENT_ID = re.compile(rb"doc-[0-9a-f]{32}")
SEEN_DOCUMENTS: list[str] = []


def note_documents(route: str, status: int | None, body: bytes) -> None:
    if not route.endswith("documents/convert") or status != 200:
        return
    for found in DOCUMENT_ID.findall(body):
        if found.decode() not in SEEN_DOCUMENTS:
            SEEN_DOCUMENTS.append(found.decode())


def _seen_document(draw: int) -> str:
    return SEEN_DOCUMENTS[draw % len(SEEN_DOCUMENTS)] if SEEN_DOCUMENTS else "doc-" + "0" * 32


HEX = "0123456789abcdef"
seen_documents = st.integers(0, 1 << 16).map(_seen_document)
document_ids = st.one_of(
    seen_documents,
    seen_documents,
    seen_documents,
    st.text(st.sampled_from(HEX), min_size=32, max_size=32).map(lambda h: "doc-" + h),
    st.sampled_from(
        [
            "doc-" + "0" * 31,
            "doc-" + "0" * 33,
            "DOC-" + "0" * 32,
            "doc-" + "A" * 32,
            "doc-" + "g" * 32,
            "doc-",
            "..",
            "%2e%2e",
            "..%2f..%2fetc%2fpasswd",
            "doc-" + "0" * 32 + "%2f..",
            "doc-" + "0" * 32 + "%00",
            "convert",
            "%00",
        ]
    ),
    SHORT_TEXT.filter(bool).map(path_segment),
)
# Mostly 1, the picture every stored document of the fuzz run has.
picture_indexes = st.sampled_from(
    ["1"] * 6 + ["0", "2", "3", "-1", "x", "01", "1.5", "%31", " 1", str(2**31), str(2**63 - 1), str(2**63), "9" * 40]
)
picture_formats = st.sampled_from(["", "", "?format=image", "?format=image", "?format=json", "?format=png", "?format="])
