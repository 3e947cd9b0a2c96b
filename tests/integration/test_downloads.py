"""`manage.py fetchmodels` (./run.sh models) against a real HTTP server on 127.0.0.1 standing in
for the hub: Range resume, dropped connections, a token for gated files, size and sha256 checks,
and files the catalog lists no size or sha256 for (checked against what the server declares:
Hugging Face's X-Linked-Size and X-Linked-Etag on its redirect to storage, else the length it
announces)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import tqdm
from django.core.management import CommandError, call_command

from hypnos_site.config import BASE_DIR
from models_registry import downloads

PAYLOAD = random.Random(5).randbytes((4 << 20) + 123)
SHA256 = hashlib.sha256(PAYLOAD).hexdigest()
TOKEN = "hf_test_token"
LFS_PATH = "/acme/lfs-GGUF/resolve/main/big.gguf"


@dataclass
class HubState:
    """What the server serves and what it saw. `drops`: how many of the next answers stop after
    `drop_after` bytes of their body and close the connection; `after_drop`: files that change
    then. `no_length`: bodies go chunked, without a Content-Length; `open_total`: a 206 states
    no full length (`bytes a-b/*`); `answer_head` False: HEAD gets 405. `linked`: paths answered
    as Hugging Face answers an LFS file, a 302 to another path (its storage) that declares
    X-Linked-Size and X-Linked-Etag (each left out when None)."""

    files: dict[str, bytes]
    gated: set[str] = field(default_factory=set)
    honour_range: bool = True
    drops: int = 0
    drop_after: int = 1 << 20
    after_drop: dict[str, bytes] = field(default_factory=dict)
    no_length: bool = False
    open_total: bool = False
    answer_head: bool = True
    linked: dict[str, tuple[str, int | None, str | None]] = field(default_factory=dict)
    sent: int = 0
    requests: list[dict[str, str | None]] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState

    def do_GET(self) -> None:
        state = self.state
        state.requests.append(
            {"path": self.path, "range": self.headers.get("Range"), "authorization": self.headers.get("Authorization")}
        )
        if self.path in state.linked:
            return self._to_storage()
        body = state.files.get(self.path)
        if body is None:
            return self._empty(404)
        if self.path in state.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._empty(401)
        start = 0
        wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if wanted and state.honour_range:
            start = int(wanted[1])
            if start >= len(body):
                return self._empty(416)
            self.send_response(206)
            total = "*" if state.open_total else len(body)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{total}")
        else:
            self.send_response(200)
        payload = body[start:]
        if state.no_length:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        dropped = state.drops > 0
        if dropped:
            state.drops -= 1
            payload = payload[: state.drop_after]
            self.close_connection = True
            state.files.update(state.after_drop)
        if state.no_length:
            # One chunk, and the closing one only when the body is whole.
            self.wfile.write(f"{len(body) - start:x}\r\n".encode() + payload + (b"" if dropped else b"\r\n0\r\n\r\n"))
        else:
            self.wfile.write(payload)
        state.sent += len(payload)

    def do_HEAD(self) -> None:
        state = self.state
        state.heads.append(self.path)
        if self.path in state.linked and state.answer_head:
            return self._to_storage()
        body = state.files.get(self.path)
        if body is None or not state.answer_head:
            return self._empty(404 if body is None else 405)
        self.send_response(200)
        if not state.no_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()

    def _to_storage(self) -> None:
        target, size, sha256 = self.state.linked[self.path]
        self.send_response(302)
        self.send_header("Location", f"http://{self.headers['Host']}{target}")
        if size is not None:
            self.send_header("X-Linked-Size", str(size))
        if sha256 is not None:
            self.send_header("X-Linked-Etag", f'"{sha256}"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def settled_count(state: HubState, expected: int, timeout: float = 30.0) -> bool:
    """The server counts what it sent after writing it, on its own thread: a client that has
    read every byte may look before that count lands."""
    deadline = time.monotonic() + timeout
    while state.sent != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return state.sent == expected


class HubServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that stops reading (a refused size, a range it discards) resets the connection.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, HubState]]:
    """A hub on a free port, named by HF_ENDPOINT for the test; HF_TOKEN unset."""
    state = HubState(
        files={
            "/acme/tiny-GGUF/resolve/main/tiny-F16.gguf": PAYLOAD,
            "/acme/tiny-GGUF/resolve/main/tiny-Q8_0.gguf": PAYLOAD[:1000],
            "/acme/locked-GGUF/resolve/main/locked.gguf": PAYLOAD,
            "/mirror/plain.bin": PAYLOAD[:5000],
            "/storage/big.gguf": PAYLOAD,
        },
        gated={"/acme/locked-GGUF/resolve/main/locked.gguf"},
        linked={
            LFS_PATH: ("/storage/big.gguf", len(PAYLOAD), SHA256),
            "/acme/lfs-GGUF/resolve/main/other-hash.gguf": ("/storage/big.gguf", len(PAYLOAD), "0" * 64),
            "/acme/lfs-GGUF/resolve/main/other-size.gguf": ("/storage/big.gguf", len(PAYLOAD) + 7, None),
        },
    )
    handler = type("Handler", (HubHandler,), {"state": state})
    server = HubServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield url, state
    server.shutdown()
    server.server_close()


def variant(quant: str, files: str, default: bool = False) -> str:
    return f'[[models.variants]]\nquant = "{quant}"\ndefault = {str(default).lower()}\n{files}'


def hub_file(repo: str, remote: str, size: int | None, extra: str = "") -> str:
    listed = f"size = {size}\n" if size is not None else ""
    return (
        f'[[models.variants.files]]\nrole = "weights"\nrepo = "{repo}"\nremote = "{remote}"\n'
        f'local = "{remote}"\n{listed}{extra}\n'
    )


def entry(model_id: str, *variants: str) -> str:
    return (
        f'[[models]]\nid = "{model_id}"\nname = "{model_id}"\npublisher = "Acme"\nlicense = "mit"\n'
        f'architecture = "llama"\nmodality = "text_generation"\nengine = "ggml_llama"\nsummary = "test"\n'
        + "".join(variants)
    )


@pytest.fixture
def catalog(tmp_path: Path, hub: tuple[str, HubState]) -> Path:
    url, _ = hub
    tqdm_main = Path(tqdm.__file__).with_name("_main.py")
    text = 'catalog_version = 1\ntested_architectures = ["llama"]\n' + "".join(
        [
            entry(
                "tiny:1b",
                variant(
                    "F16",
                    hub_file("acme/tiny-GGUF", "tiny-F16.gguf", len(PAYLOAD), f'sha256 = "{SHA256}"'),
                    default=True,
                ),
                variant("Q8_0", hub_file("acme/tiny-GGUF", "tiny-Q8_0.gguf", 1000)),
            ),
            entry("wrong-size", variant("F16", hub_file("acme/tiny-GGUF", "tiny-F16.gguf", len(PAYLOAD) + 1), True)),
            entry(
                "wrong-hash",
                variant(
                    "F16", hub_file("acme/tiny-GGUF", "tiny-F16.gguf", len(PAYLOAD), f'sha256 = "{"0" * 64}"'), True
                ),
            ),
            entry(
                "locked",
                variant("F16", hub_file("acme/locked-GGUF", "locked.gguf", len(PAYLOAD), "gated = true"), True),
            ),
            entry("missing", variant("F16", hub_file("acme/tiny-GGUF", "nowhere.gguf", 10), True)),
            entry("mirrored", variant("F16", hub_file(f"{url}/mirror/", "plain.bin", 5000), True)),
            # No size in the catalog: the server's word is the check.
            entry("unsized", variant("F16", hub_file("acme/tiny-GGUF", "tiny-F16.gguf", None), True)),
            # Neither size nor sha256 in the catalog: what the hub's redirect declares is the check.
            entry("lfs", variant("Q4_K_M", hub_file("acme/lfs-GGUF", "big.gguf", None), True)),
            entry("lfs-other-hash", variant("Q4_K_M", hub_file("acme/lfs-GGUF", "other-hash.gguf", None), True)),
            entry("lfs-other-size", variant("Q4_K_M", hub_file("acme/lfs-GGUF", "other-size.gguf", None), True)),
            entry(
                "lfs-listed-hash",
                variant("Q4_K_M", hub_file("acme/lfs-GGUF", "other-hash.gguf", None, f'sha256 = "{SHA256}"'), True),
            ),
            # A package-sourced file: an installed package's own file stands in for model weights.
            entry(
                "packaged",
                variant(
                    "any",
                    f'[[models.variants.files]]\nrole = "data"\n'
                    f'package = "tqdm=={importlib.metadata.version("tqdm")}"\n'
                    f'local = "packaged/_main.py"\nsize = {tqdm_main.stat().st_size}\n',
                    True,
                ),
            ),
            entry(
                "packaged-folder",
                variant(
                    "any",
                    f'[[models.variants.files]]\nrole = "data"\npackage = "tqdm"\n'
                    f'package_path = "contrib"\nlocal = "tqdm-contrib"\n'
                    f"size = {folder_bytes(tqdm_main.with_name('contrib'))}\n",
                    True,
                ),
            ),
        ]
    )
    path = tmp_path / "models.catalog.toml"
    path.write_text(text)
    return path


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def fetchmodels(catalog: Path, models_dir: Path, *specs: str, token: str | None = None) -> str:
    out = io.StringIO()
    options = {"token": token} if token else {}
    call_command("fetchmodels", *specs, catalog=catalog, models_dir=models_dir, stdout=out, **options)
    return out.getvalue()


def test_it_downloads_the_default_variant_and_then_finds_it_there(catalog, hub, tmp_path):
    _, state = hub
    models = tmp_path / "models"
    printed = fetchmodels(catalog, models, "tiny:1b")
    assert (models / "tiny-F16.gguf").read_bytes() == PAYLOAD
    assert not (models / "tiny-F16.gguf.part").exists()
    assert "tiny:1b:F16 tiny-F16.gguf" in printed and "(downloaded)" in printed
    assert state.requests[0]["authorization"] is None
    again = fetchmodels(catalog, models, "tiny:1b")
    assert "(already there)" in again and len(state.requests) == 1


def test_it_downloads_a_named_quant(catalog, hub, tmp_path):
    fetchmodels(catalog, tmp_path, "tiny:1b:Q8_0")
    assert (tmp_path / "tiny-Q8_0.gguf").read_bytes() == PAYLOAD[:1000]
    assert not (tmp_path / "tiny-F16.gguf").exists()


def test_it_resumes_a_dropped_connection_within_the_run(catalog, hub, tmp_path):
    _, state = hub
    state.drops = 1
    fetchmodels(catalog, tmp_path, "tiny:1b")
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD
    assert settled_count(state, len(PAYLOAD))
    assert [r["range"] for r in state.requests] == [None, f"bytes={state.drop_after}-"]


def test_the_next_run_fetches_only_what_an_interrupted_run_left_out(catalog, hub, tmp_path):
    _, state = hub
    state.drops = 3  # the first try and both retries
    with pytest.raises(CommandError, match="run the same command again to resume"):
        fetchmodels(catalog, tmp_path, "tiny:1b")
    part = tmp_path / "tiny-F16.gguf.part"
    kept = part.stat().st_size
    assert settled_count(state, 3 * state.drop_after) and kept == state.sent
    assert not (tmp_path / "tiny-F16.gguf").exists()
    state.sent = 0
    fetchmodels(catalog, tmp_path, "tiny:1b")
    assert settled_count(state, len(PAYLOAD) - kept) and state.requests[-1]["range"] == f"bytes={kept}-"
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD and not part.exists()


def test_a_server_that_ignores_the_range_gets_the_file_from_the_start(catalog, hub, tmp_path):
    _, state = hub
    state.honour_range = False
    (tmp_path / "tiny-F16.gguf.part").write_bytes(b"x" * 1000)
    fetchmodels(catalog, tmp_path, "tiny:1b")
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD and settled_count(state, len(PAYLOAD))


def test_a_part_that_is_no_prefix_of_a_shorter_remote_restarts_after_416(catalog, hub, tmp_path):
    _, state = hub
    state.answer_head = False  # no declaration to refuse the shorter file before the GET
    (tmp_path / "tiny-Q8_0.gguf.part").write_bytes(b"x" * 999)
    state.files["/acme/tiny-GGUF/resolve/main/tiny-Q8_0.gguf"] = PAYLOAD[:900]
    with pytest.raises(CommandError, match="is 900 bytes, the catalog lists 1000"):
        fetchmodels(catalog, tmp_path, "tiny:1b:Q8_0")
    assert [r["range"] for r in state.requests] == ["bytes=999-", None]
    assert not (tmp_path / "tiny-Q8_0.gguf").exists()


def test_a_remote_file_of_another_size_is_refused(catalog, hub, tmp_path):
    _, state = hub
    with pytest.raises(CommandError, match=f"is {len(PAYLOAD)} bytes, the catalog lists {len(PAYLOAD) + 1}"):
        fetchmodels(catalog, tmp_path, "wrong-size")
    # The HEAD that asked for its sha256 declared the size: refused before any GET.
    assert not (tmp_path / "tiny-F16.gguf").exists() and state.requests == [] and state.sent == 0
    state.answer_head = False
    with pytest.raises(CommandError, match=f"is {len(PAYLOAD)} bytes, the catalog lists {len(PAYLOAD) + 1}"):
        fetchmodels(catalog, tmp_path, "wrong-size")
    assert not (tmp_path / "tiny-F16.gguf").exists() and state.sent == 0


def test_a_download_with_another_sha256_is_discarded(catalog, hub, tmp_path):
    with pytest.raises(CommandError, match="sha256 .* is not the catalog's 0000"):
        fetchmodels(catalog, tmp_path, "wrong-hash")
    assert list(tmp_path.glob("tiny-F16*")) == []


def test_a_gated_file_without_a_token_is_refused_before_any_request(catalog, hub, tmp_path):
    _, state = hub
    with pytest.raises(CommandError, match="gated repository acme/locked-GGUF: set HF_TOKEN"):
        fetchmodels(catalog, tmp_path, "locked")
    assert state.requests == []


def test_a_gated_file_is_fetched_with_the_token_from_hf_token(catalog, hub, tmp_path, monkeypatch):
    _, state = hub
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    fetchmodels(catalog, tmp_path, "locked")
    assert (tmp_path / "locked.gguf").read_bytes() == PAYLOAD
    assert state.requests[0]["authorization"] == f"Bearer {TOKEN}"


def test_a_refused_token_is_told_to_accept_the_license(catalog, hub, tmp_path):
    with pytest.raises(CommandError, match=r"HTTP 401.*accepted the model's license"):
        fetchmodels(catalog, tmp_path, "locked", token="hf_someone_else")
    assert not (tmp_path / "locked.gguf").exists()


def test_a_base_url_file_is_fetched_without_the_token(catalog, hub, tmp_path):
    _, state = hub
    fetchmodels(catalog, tmp_path, "mirrored", token=TOKEN)
    assert (tmp_path / "plain.bin").read_bytes() == PAYLOAD[:5000]
    assert state.requests == [{"path": "/mirror/plain.bin", "range": None, "authorization": None}]


def test_a_missing_remote_file_is_a_404_error(catalog, hub, tmp_path):
    with pytest.raises(CommandError, match="does not exist \\(HTTP 404\\)"):
        fetchmodels(catalog, tmp_path, "missing")


def test_an_unreachable_hub_is_a_clear_error(catalog, tmp_path, monkeypatch):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(CommandError, match="failed \\(ConnectError"):
        fetchmodels(catalog, tmp_path, "tiny:1b:Q8_0")


def test_a_failed_download_leaves_no_folder_and_names_no_part_it_did_not_write(hub, tmp_path, monkeypatch):
    """Once a failed pull left empty folders in models_dir and its message named a `.part` that
    did not exist."""
    import httpx

    from models_registry.downloads import DownloadError, download

    base, _ = hub
    models = tmp_path / "models"
    models.mkdir()
    dest = models / "acme" / "nested" / "gone.gguf"
    with httpx.Client() as client, pytest.raises(DownloadError, match="HTTP 404"):
        download(client, f"{base}/acme/none/resolve/main/gone.gguf", dest, 100, retries=0)
    assert list(models.iterdir()) == []
    with socket.socket() as probe:  # nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with httpx.Client() as client, pytest.raises(DownloadError) as refused:
        download(client, f"http://127.0.0.1:{port}/gone.gguf", dest, 100, retries=0)
    assert "nothing was written" in str(refused.value) and ".part" not in str(refused.value)
    assert list(models.iterdir()) == []


def test_what_does_not_fit_on_disk_is_refused_with_the_numbers(catalog, hub, tmp_path, monkeypatch):
    _, state = hub
    monkeypatch.setattr(downloads, "_free_bytes", lambda path: 1 << 20)
    message = f"{len(PAYLOAD)} > {1 << 20} bytes"
    with pytest.raises(CommandError, match=f"not enough disk space on {tmp_path}: .*{message}"):
        fetchmodels(catalog, tmp_path / "models", "tiny:1b")
    assert state.requests == [] and not (tmp_path / "models").exists()


def test_unknown_ids_and_quants_are_named(catalog, tmp_path):
    with pytest.raises(CommandError, match="'nope' is not in the catalog"):
        fetchmodels(catalog, tmp_path, "nope")
    with pytest.raises(CommandError, match="'tiny:1b' has no variant 'Q2_K' \\(it has F16, Q8_0\\)"):
        fetchmodels(catalog, tmp_path, "tiny:1b:Q2_K")


def test_a_package_file_is_placed_from_the_installed_package(catalog, tmp_path):
    printed = fetchmodels(catalog, tmp_path, "packaged")
    placed = tmp_path / "packaged" / "_main.py"
    assert placed.read_bytes() == Path(tqdm.__file__).with_name("_main.py").read_bytes()
    assert "(placed)" in printed


def test_a_package_folder_is_copied_whole_and_then_found_there(catalog, tmp_path):
    source = Path(tqdm.__file__).with_name("contrib")
    assert "(placed)" in fetchmodels(catalog, tmp_path, "packaged-folder")
    assert (tmp_path / "tqdm-contrib" / "itertools.py").read_bytes() == (source / "itertools.py").read_bytes()
    assert folder_bytes(tmp_path / "tqdm-contrib") == folder_bytes(source)
    assert "(already there)" in fetchmodels(catalog, tmp_path, "packaged-folder")


def test_the_command_runs_as_a_process(catalog, hub, tmp_path):
    url, _ = hub
    env = {**os.environ, "HF_ENDPOINT": url}
    env.pop("HF_TOKEN", None)
    command = [sys.executable, "manage.py", "fetchmodels", "--catalog", str(catalog), "--models-dir", str(tmp_path)]
    done = subprocess.run([*command, "tiny:1b"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD
    refused = subprocess.run([*command, "locked"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "CommandError: locked:F16 locked.gguf comes from the gated repository acme/locked-GGUF: set HF_TOKEN (or "
        f"--token) to a token of a Hugging Face account that accepted the model's license at {url}/acme/locked-GGUF"
    ]


# -- files the catalog lists no size for --------------------------------------------------------

F16_PATH = "/acme/tiny-GGUF/resolve/main/tiny-F16.gguf"


def test_a_file_without_a_catalog_size_is_checked_against_the_content_length(catalog, hub, tmp_path):
    _, state = hub
    printed = fetchmodels(catalog, tmp_path, "unsized")
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD and "(downloaded)" in printed
    # The disk check asked for the size first.
    assert state.heads == [F16_PATH] and len(state.requests) == 1
    # Present, with no size to find it outdated against: there.
    (tmp_path / "tiny-F16.gguf").write_bytes(b"changed")
    assert "(already there)" in fetchmodels(catalog, tmp_path, "unsized") and len(state.requests) == 1


@pytest.mark.parametrize(
    ("answer_head", "said"), [(True, "the server declared"), (False, "the server first announced")]
)
def test_a_file_whose_size_changes_during_the_download_is_refused(catalog, hub, tmp_path, answer_head, said):
    _, state = hub
    state.answer_head = answer_head
    state.drops, state.after_drop = 1, {F16_PATH: PAYLOAD[: 2 << 20]}
    with pytest.raises(CommandError, match=f"is {2 << 20} bytes, {said} {len(PAYLOAD)}"):
        fetchmodels(catalog, tmp_path, "unsized")
    assert [r["range"] for r in state.requests] == [None, f"bytes={state.drop_after}-"]
    assert not (tmp_path / "tiny-F16.gguf").exists()


def test_a_server_without_content_length_gives_a_file_marked_unchecked(catalog, hub, tmp_path):
    _, state = hub
    state.no_length = True
    printed = fetchmodels(catalog, tmp_path, "unsized")
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD
    assert "(downloaded; no size to check it against: neither the catalog nor the server gave one)" in printed


def test_a_chunked_download_cut_short_resumes_once_the_range_states_the_full_length(catalog, hub, tmp_path):
    _, state = hub
    state.no_length, state.drops = True, 1
    printed = fetchmodels(catalog, tmp_path, "unsized")
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD and "(downloaded)" in printed
    assert [r["range"] for r in state.requests] == [None, f"bytes={state.drop_after}-"]


def test_the_next_run_resumes_an_unsized_file_when_the_server_states_its_full_length(catalog, hub, tmp_path):
    _, state = hub
    state.drops = 3
    with pytest.raises(CommandError, match=f"{3 * state.drop_after} of {len(PAYLOAD)} bytes are kept"):
        fetchmodels(catalog, tmp_path, "unsized")
    kept = (tmp_path / "tiny-F16.gguf.part").stat().st_size
    state.sent = 0
    assert "(downloaded)" in fetchmodels(catalog, tmp_path, "unsized")
    assert settled_count(state, len(PAYLOAD) - kept) and state.requests[-1]["range"] == f"bytes={kept}-"
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD


def test_an_unsized_part_the_server_gives_no_full_length_for_starts_over(catalog, hub, tmp_path):
    _, state = hub
    state.open_total, state.answer_head = True, False
    (tmp_path / "tiny-F16.gguf.part").write_bytes(PAYLOAD[:1000])
    fetchmodels(catalog, tmp_path, "unsized")
    assert [r["range"] for r in state.requests] == ["bytes=1000-", None]
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD and not (tmp_path / "tiny-F16.gguf.part").exists()


def test_an_unsized_part_is_resumed_when_the_head_declared_the_size(catalog, hub, tmp_path):
    _, state = hub
    state.open_total = True  # the 206 states no full length: the declared size is the check
    (tmp_path / "tiny-F16.gguf.part").write_bytes(PAYLOAD[:1000])
    assert "(downloaded)" in fetchmodels(catalog, tmp_path, "unsized")
    assert [r["range"] for r in state.requests] == ["bytes=1000-"]
    assert (tmp_path / "tiny-F16.gguf").read_bytes() == PAYLOAD


def test_the_disk_check_counts_an_unsized_file_with_its_head_content_length(catalog, hub, tmp_path, monkeypatch):
    _, state = hub
    monkeypatch.setattr(downloads, "_free_bytes", lambda path: 1 << 20)
    with pytest.raises(CommandError, match=f"{len(PAYLOAD)} > {1 << 20} bytes\\)$"):
        fetchmodels(catalog, tmp_path, "unsized")
    assert state.heads == [F16_PATH] and state.requests == []


def test_the_disk_check_names_an_unsized_file_it_could_not_count(catalog, hub, tmp_path, monkeypatch):
    _, state = hub
    state.answer_head = False
    monkeypatch.setattr(downloads, "_free_bytes", lambda path: 500)
    left_out = "not counted, no size known before the download: unsized:F16 tiny-F16.gguf"
    with pytest.raises(CommandError, match=f"\\(1000 > 500 bytes\\); {left_out}"):
        fetchmodels(catalog, tmp_path, "tiny:1b:Q8_0", "unsized")
    assert state.requests == []
    # Alone, it is left out of the check, and the download shows whether it fits.
    assert "(downloaded)" in fetchmodels(catalog, tmp_path, "unsized")


# -- what the hub declares on its redirect to storage ---------------------------------------------


def test_a_file_the_catalog_lists_nothing_for_is_checked_against_what_the_redirect_declares(catalog, hub, tmp_path):
    _, state = hub
    printed = fetchmodels(catalog, tmp_path, "lfs")
    assert (tmp_path / "big.gguf").read_bytes() == PAYLOAD and "(downloaded)" in printed
    # The HEAD stops at the redirect, which declares the size and sha256; the GET follows it.
    assert state.heads == [LFS_PATH]
    assert [r["path"] for r in state.requests] == [LFS_PATH, "/storage/big.gguf"]


def test_a_download_whose_sha256_is_not_the_declared_one_is_discarded(catalog, hub, tmp_path):
    with pytest.raises(CommandError, match=f"sha256 {SHA256} is not the one the server declared {'0' * 64}"):
        fetchmodels(catalog, tmp_path, "lfs-other-hash")
    assert list(tmp_path.glob("other-hash*")) == []


def test_a_remote_file_that_is_not_the_declared_size_is_refused_unwritten(catalog, hub, tmp_path):
    _, state = hub
    with pytest.raises(CommandError, match=f"is {len(PAYLOAD)} bytes, the server declared {len(PAYLOAD) + 7}"):
        fetchmodels(catalog, tmp_path, "lfs-other-size")
    assert list(tmp_path.glob("other-size*")) == [] and state.sent == 0


def test_a_body_short_of_the_declared_size_is_discarded(catalog, hub, tmp_path):
    _, state = hub
    state.no_length = True  # nothing but the declaration says how long the file is
    with pytest.raises(CommandError, match=f"received {len(PAYLOAD)} bytes, the server declared {len(PAYLOAD) + 7}"):
        fetchmodels(catalog, tmp_path, "lfs-other-size")
    assert list(tmp_path.glob("other-size*")) == [] and settled_count(state, len(PAYLOAD))


def test_a_declared_sha256_other_than_the_catalogs_refuses_before_the_download(catalog, hub, tmp_path):
    _, state = hub
    with pytest.raises(CommandError, match=f"declares the sha256 {'0' * 64}, the catalog lists {SHA256}"):
        fetchmodels(catalog, tmp_path, "lfs-listed-hash")
    assert state.requests == [] and list(tmp_path.glob("other-hash*")) == []


def test_a_part_is_resumed_through_the_redirect_against_the_declared_size(catalog, hub, tmp_path):
    _, state = hub
    state.open_total = True
    (tmp_path / "big.gguf.part").write_bytes(PAYLOAD[:1000])
    assert "(downloaded)" in fetchmodels(catalog, tmp_path, "lfs")
    assert [r["range"] for r in state.requests] == ["bytes=1000-", "bytes=1000-"]
    assert (tmp_path / "big.gguf").read_bytes() == PAYLOAD and not (tmp_path / "big.gguf.part").exists()


def test_the_disk_check_counts_a_file_with_its_declared_size(catalog, hub, tmp_path, monkeypatch):
    _, state = hub
    monkeypatch.setattr(downloads, "_free_bytes", lambda path: 1 << 20)
    with pytest.raises(CommandError, match=f"{len(PAYLOAD)} > {1 << 20} bytes\\)$"):
        fetchmodels(catalog, tmp_path, "lfs")
    assert state.heads == [LFS_PATH] and state.requests == []
