"""Registry pulls and deletes, shared by Ollama's /api/pull and /api/delete and Lemonade's
/api/v1/pull and /api/v1/delete.

A pull fetches a catalog variant into models_dir with the download code of `./run.sh models`
(resumed after an interruption, checked for size and sha256, package files placed as
`installmodels` places them), yields Ollama's progress lines (each surface answers them in its
own form), and adds the model to the pool as POST /v1/models adds it (persisted). `name` is
`<catalog id>`, `<id>:latest` (the default variant) or `<id>:<quant>`. A removal takes the model
out of the pool as DELETE /v1/models/{id} does and removes its files from models_dir, unless
another model of the pool uses them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

from django.conf import settings

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InsufficientStorage, InvalidRequest, NotFound, OllamaModelNotFound, PullFailed
from inference.transport.client import InferenceClient
from inference.web.common import pool as pool_changes
from inference.web.common.pool import pool
from models_registry.catalog import Catalog, CatalogEntry, CatalogVariant, catalog_path, load_catalog
from models_registry.downloads import (
    DownloadError,
    PlannedFile,
    check_disk_space,
    fetch,
    hub_endpoint,
    plan,
    space_needed,
)

# Progress lines of one file at most this often (the last one always).
PROGRESS_EVERY_SECS = 0.1


class _Stopped(Exception):
    """Raised in the download thread when the client has gone: the `.part` stays to resume."""


def _catalog() -> Catalog:
    path = catalog_path(settings.HYPNOS)
    if not path.exists():
        raise NotFound("This server has no models.catalog.toml to pull from.")
    return load_catalog(path)


def catalog_variant(catalog: Catalog, name: str) -> tuple[CatalogEntry, CatalogVariant]:
    """The entry and variant an Ollama name pulls: the default variant for a bare id or
    `:latest`, else the variant whose quant is the tag (any case); 404 otherwise."""
    entry = next((e for e in catalog.models if e.id == name), None)
    tag = "latest"
    if entry is None:
        base, colon, tag = name.rpartition(":")
        entry = next((e for e in catalog.models if colon and e.id == base), None)
    if entry is None:
        raise OllamaModelNotFound(name)
    if tag == "latest":
        variant = next((v for v in entry.variants if v.default), entry.variants[0])
    else:
        found = next((v for v in entry.variants if v.quant.lower() == tag.lower()), None)
        if found is None:
            raise OllamaModelNotFound(name)
        variant = found
    return entry, variant


def plan_pull(name: str) -> tuple[CatalogEntry, CatalogVariant, list[PlannedFile]]:
    entry, variant = catalog_variant(_catalog(), name)
    try:
        planned = plan(entry, variant, settings.HYPNOS.models_dir)
        # The sizes the catalog lists; a file it lists none for is checked by fetch itself.
        check_disk_space(space_needed(planned, settings.HYPNOS.models_dir))
    except DownloadError as exc:
        if "disk space" in str(exc):
            raise InsufficientStorage(str(exc)) from exc
        raise InvalidRequest(str(exc), param="model") from exc
    return entry, variant, planned


def digest(item: PlannedFile) -> str:
    """The file's sha256 when the catalog lists one, else its name under models_dir."""
    known = item.file.sha256 or (item.variant.sha256 if item.file.role == "weights" else None)
    return f"sha256:{known}" if known else item.file.local


def progress(item: PlannedFile, completed: int, total: int | None) -> dict[str, Any]:
    """One file's progress as Ollama words a layer's: "pulling" and the digest's first 12 hex
    digits (the file's name when the catalog lists no checksum)."""
    shown = digest(item)
    short = shown.removeprefix("sha256:")[:12] if shown.startswith("sha256:") else shown
    return {"status": f"pulling {short}", "digest": shown, "total": total or completed, "completed": completed}


class _Download:
    """One file fetched on a thread, its progress handed to the event loop as it arrives."""

    def __init__(self, item: PlannedFile):
        self.item = item
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
        self.stop = threading.Event()
        self.last = 0.0

    def on_bytes(self, item: PlannedFile, done: int, total: int | None) -> None:
        """On the download thread: every chunk; passed on at most every PROGRESS_EVERY_SECS."""
        if self.stop.is_set():
            raise _Stopped
        now = time.monotonic()
        if done != total and now - self.last < PROGRESS_EVERY_SECS:
            return
        self.last = now
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (done, total))

    def _fetch(self) -> None:
        models_dir = settings.HYPNOS.models_dir
        token = os.environ.get("HF_TOKEN")
        fetch([self.item], models_dir, hub=hub_endpoint(), token=token, progress=False, on_bytes=self.on_bytes)

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        """The file's progress objects until it is in place; PullFailed when the download fails."""
        task = asyncio.ensure_future(asyncio.to_thread(self._fetch))
        try:
            while not task.done() or not self.queue.empty():
                getter = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield progress(self.item, *getter.result())
                else:
                    getter.cancel()
            try:
                task.result()
            except DownloadError as exc:
                raise PullFailed(str(exc)) from exc
        finally:
            # The client left (or the pull failed): the thread stops at its next chunk.
            self.stop.set()


async def pull_lines(
    client: InferenceClient, planned: list[PlannedFile], spec: str
) -> AsyncGenerator[dict[str, Any], None]:
    yield {"status": "pulling manifest"}
    for item in planned:
        if item.there:
            size = item.file.known_size(settings.HYPNOS.models_dir) or 0
            yield progress(item, size, size)
            continue
        async for shown in _Download(item).lines():
            yield shown
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    entry_id = spec.rpartition(":")[0]
    await pool.ensure(client)
    if not any(entry_id in (m.id, *m.aliases) for m in pool.models()):
        await pool_changes.add_model(client, {"catalog": spec})
    yield {"status": "success"}


# -- delete ------------------------------------------------------------------------------------


def _files_to_remove(model_id: str, files: list[Path]) -> list[Path]:
    """The model's files that lie inside models_dir and no other model of the pool uses."""
    root = settings.HYPNOS.models_dir.resolve()
    config = settings.HYPNOS
    used = {
        path.resolve()
        for other in pool.models()
        if other.id != model_id
        for path in (config.weights_file(other), config.aux_file(other))
        if path is not None
    }
    return [p for p in (f.resolve() for f in files) if p.is_relative_to(root) and p != root and p not in used]


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


async def remove(client: InferenceClient, model: ModelConfig) -> None:
    """Take `model` out of the pool once its requests are done, then remove its files from
    models_dir, unless another model of the pool uses them."""
    config = settings.HYPNOS
    files = [p for p in (config.weights_file(model), config.aux_file(model)) if p is not None]
    doomed = await asyncio.to_thread(_files_to_remove, model.id, files)
    await pool_changes.remove_model(client, model.id, 120)
    await asyncio.to_thread(_remove, doomed)
