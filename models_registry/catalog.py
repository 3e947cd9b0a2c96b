"""The model catalog (`models.catalog.toml`): tested models, their variants and files, what of
them is on disk, and the [[models]] block that runs each variant (spec §6)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hypnos_site.config import BASE_DIR, HypnosConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CatalogFile(_Strict):
    role: Literal["weights", "aux", "text_encoder", "tokenizer", "voices", "data"]
    package: str
    parts: int | None = Field(default=None, ge=1)
    local: str
    size: int = Field(ge=0)
    platform: Literal["all", "macos-arm64", "other"] = "all"


class CatalogVariant(_Strict):
    quant: str
    default: bool = False
    context_len: int = 4096
    sha256: str | None = None
    tool_router: bool = False
    files: list[CatalogFile]


class CatalogEntry(_Strict):
    id: str
    name: str
    publisher: str
    license: str
    architecture: str
    modality: str
    additional_modalities: list[str] = []
    engine: str
    capabilities: list[str] = []
    summary: str
    lineup: bool = False
    variants: list[CatalogVariant]


class Catalog(_Strict):
    catalog_version: int
    tested_architectures: list[str]
    models: list[CatalogEntry]


def catalog_path(config: HypnosConfig) -> Path:
    """`models.catalog.toml` next to the config file (or the checkout's own)."""
    beside = Path(config.source).with_name("models.catalog.toml") if config.source else None
    return beside if beside is not None and beside.exists() else BASE_DIR / "models.catalog.toml"


def load_catalog(path: Path) -> Catalog:
    return Catalog.model_validate(tomllib.loads(path.read_text()))


def config_block(entry: CatalogEntry, variant: CatalogVariant) -> str:
    """The [[models]] TOML that runs this variant, paths relative to models_dir."""
    weights = next(f for f in variant.files if f.role == "weights")
    lines = [
        f"# {entry.name} ({variant.quant}), {entry.publisher}, license {entry.license}.",
        "[[models]]",
        f'id = "{entry.id}"',
        f'modality = "{entry.modality}"',
        f'engine = "{entry.engine}"',
        f'weights_path = "{weights.local}"',
        f"context_len = {variant.context_len}",
        f'package = "{weights.package.split("==")[0]}"',
    ]
    if weights.parts:
        lines.append(f"package_parts = {weights.parts}")
    if variant.sha256:
        lines.append(f'sha256 = "{variant.sha256}"')
    if variant.tool_router:
        lines.append("tool_router = true")
    return "\n".join(lines) + "\n"


def _file_state(config: HypnosConfig, file: CatalogFile) -> dict[str, Any]:
    path = config.models_dir / file.local
    present = path.exists()
    return {**file.model_dump(exclude_none=True), "present": present,
            "outdated": present and path.stat().st_size != file.size}


def describe(config: HypnosConfig, catalog: Catalog, modality: str | None = None) -> dict[str, Any]:
    """GET /v1/models/catalog: every entry with what this server has of it."""
    configured = {m.id: m for m in config.models}
    data = []
    for entry in catalog.models:
        if modality and modality != entry.modality and modality not in entry.additional_modalities:
            continue
        variants = []
        for variant in entry.variants:
            files = [_file_state(config, f) for f in variant.files]
            variants.append({
                **variant.model_dump(exclude={"files", "sha256", "tool_router"}),
                "size_bytes": sum(f.size for f in variant.files),
                "files": files,
                "installed": all(f["present"] for f in files),
                "outdated": any(f["outdated"] for f in files),
                "config_block": config_block(entry, variant),
            })
        model = configured.get(entry.id)
        row = {**entry.model_dump(exclude={"variants"}), "configured": model is not None,
               "enabled": bool(model and model.enabled), "variants": variants}
        if model is not None:
            row["configured_quant"] = next((v.quant for v in entry.variants
                                            if any(f.local == Path(model.weights_path).name for f in v.files)), None)
        data.append(row)
    return {"object": "list", "catalog_version": catalog.catalog_version, "models_dir": str(config.models_dir),
            "tested_architectures": catalog.tested_architectures, "data": data}
