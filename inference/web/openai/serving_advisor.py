"""POST /v1/advisor (spec §6): a lineup from the catalog for a machine and a set of needs."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from hypnos_site.errors import InvalidRequest, NotFound
from inference.web.openai.protocol import AdvisorRequest
from models_registry.advisor import NoLineup, recommend
from models_registry.catalog import catalog_path, load_catalog
from models_registry.machine import resolve_machine


def advise(body: AdvisorRequest) -> dict[str, Any]:
    """The advisor's answer; 404 without a catalog, 400 when no lineup fits the machine.
    It reads only the catalog and GGUF headers, so it answers during startup staging too."""
    config = settings.HYPNOS
    path = catalog_path(config)
    if not path.exists():
        raise NotFound("This server has no models.catalog.toml.")
    machine = resolve_machine(body.vram_bytes, body.ram_bytes, body.unified_memory, config.hardware)
    try:
        advice = recommend(load_catalog(path), list(body.needs), machine, config.models_dir)
    except NoLineup as exc:
        raise InvalidRequest(str(exc), param="needs") from exc
    return advice.as_dict()
