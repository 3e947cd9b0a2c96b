"""The model catalog (`models.catalog.toml`): tested models, their variants and files, what of
them is on disk, and the [[models]] block that runs each variant (spec §6)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hypnos_site.config import BASE_DIR, HypnosConfig, ImageConfig
from memory.gguf import GgufError, read_gguf


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CatalogFile(_Strict):
    """One file of a variant and where it comes from: a registry `package` (with `parts`, joined)
    or a hub: `repo` is a Hugging Face repository, fetched from `<hub>/<repo>/resolve/main/<remote>`,
    or an https:// base URL that `remote` is appended to (http:// too, for a mirror on the local
    network). A `remote` ending in / is a folder."""

    role: Literal["weights", "aux", "text_encoder", "tokenizer", "voices", "data"]
    package: str | None = None
    parts: int | None = Field(default=None, ge=1)
    # The file or folder inside the package (the config's package_path); a Hugging Face folder
    # placed at a local `.gguf` is converted by `manage.py convertmodels`.
    package_path: str | None = None
    repo: str | None = Field(default=None, pattern=r"^(https?://\S+/|[\w.-]+/[\w.-]+)$")
    remote: str | None = Field(default=None, min_length=1)
    # Only a Hugging Face repository is gated; spec §6 lists the key only when it is true.
    gated: bool = False
    local: str
    entry: str | None = None
    # Listed only when known to the byte: a guessed size would make every download fail its check.
    size: int | None = Field(default=None, ge=0)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    platform: Literal["all", "macos-arm64", "other"] = "all"

    @model_validator(mode="after")
    def _one_source(self) -> CatalogFile:
        if (self.package is None) == (self.repo is None):
            raise ValueError(f"{self.local}: a file comes from either a package or a repo, exactly one")
        if (self.repo is None) != (self.remote is None):
            raise ValueError(f"{self.local}: repo and remote go together")
        if self.parts and self.package is None:
            raise ValueError(f"{self.local}: parts is for package files")
        if self.gated and not self.from_hub:
            raise ValueError(f"{self.local}: only a Hugging Face repository is gated")
        return self

    @property
    def from_hub(self) -> bool:
        """From a Hugging Face repository (not a package, not a base URL)."""
        return self.repo is not None and "://" not in self.repo

    def known_size(self, models_dir: Path) -> int | None:
        """The listed size, else the size on disk under `models_dir`; None when neither is known."""
        path = models_dir / self.local
        return self.size if self.size is not None or not path.exists() else disk_size(path)

    def url(self, hub: str) -> str:
        """Where a repo file is downloaded from; `hub` is the Hugging Face endpoint."""
        assert self.repo is not None and self.remote is not None, f"{self.local} comes from a package"
        if self.from_hub:
            return f"{hub.rstrip('/')}/{self.repo}/resolve/main/{self.remote}"
        return self.repo + self.remote


class CatalogEstimate(_Strict):
    """What the advisor plans a variant with while its weights are not on disk (spec §6: the
    catalog's estimate values stand in for what the GGUF reports; a GGUF on disk is read
    instead). Engines without a GGUF need only `workspace_bytes`: they hold their files plus it.
    A weights file the catalog lists no size for counts `params` at the quantization's bits per
    weight until it is on disk."""

    # Unset: estimated from the weights file and the quantization.
    params: int | None = Field(default=None, ge=1)
    num_layers: int = Field(default=0, ge=0)
    # Tensors outside the repeating layers (token embeddings, output head, norms).
    other_bytes: int = Field(default=0, ge=0)
    kv_bytes_per_token: int = Field(default=0, ge=0)
    workspace_bytes: int = Field(default=0, ge=0)
    trained_context_len: int = Field(default=0, ge=0)
    # A Mixture-of-Experts model's routed experts (part of the layers); 0 for a dense model.
    expert_bytes: int = Field(default=0, ge=0)


class CatalogVariant(_Strict):
    quant: str
    default: bool = False
    context_len: int = 4096
    sha256: str | None = None
    tool_router: bool = False
    estimate: CatalogEstimate | None = None
    # An image model's [models.image] (steps, cfg_scale, edit, text_encoders by role), written
    # into its config block; text_encoders name files of the variant by their `local`.
    image: ImageConfig | None = None
    files: list[CatalogFile]

    @model_validator(mode="after")
    def _encoders_are_files(self) -> CatalogVariant:
        locals_ = {f.local for f in self.files}
        missing = [path for path in (self.image.text_encoders if self.image else {}).values() if path not in locals_]
        if missing:
            raise ValueError(f"{self.quant}: image.text_encoders names {missing}, not a file of the variant")
        return self


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
    # Part of the lineup users with a GPU run: the advisor proposes the entry only for a machine
    # with a GPU (or unified memory), and there before the entries without the flag. Configured by
    # hand it runs on a CPU as well, slowly.
    gpu: bool = False
    # Names the config block gives the model besides its id (OpenAI's, for drop-in clients).
    aliases: list[str] = []
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


class UnknownSpec(LookupError):
    """A catalog spec (`<id>` or `<id>:<quant>`) that names no entry or no variant."""


def find_variant(catalog: Catalog, spec: str) -> tuple[CatalogEntry, CatalogVariant]:
    """The entry and variant `<id>[:<quant>]` names; without a quant, the default variant.
    Ids may hold colons themselves, so the longest id that the spec starts with wins."""
    entries = [e for e in catalog.models if spec == e.id or spec.startswith(e.id + ":")]
    if not entries:
        raise UnknownSpec(f"{spec!r} is not in the catalog (GET /v1/models/catalog lists it).")
    entry = max(entries, key=lambda e: len(e.id))
    quant = spec[len(entry.id) + 1 :] if spec != entry.id else None
    variant = next((v for v in entry.variants if (v.quant == quant if quant else v.default)), None)
    if variant is None:
        quants = ", ".join(v.quant for v in entry.variants)
        raise UnknownSpec(f"The catalog entry {entry.id!r} has no variant {quant!r} (it has {quants}).")
    return entry, variant


def config_block(entry: CatalogEntry, variant: CatalogVariant, settings: dict[str, object] | None = None) -> str:
    """The [[models]] TOML that runs this variant, paths relative to models_dir. `settings` adds
    keys to the block or replaces them (the advisor's context_len, initial_tier, priority...)."""
    weights = next(f for f in variant.files if f.role == "weights")
    lines = _block_lines(entry, variant, weights)
    start = next((i for i, line in enumerate(lines) if line.startswith("[models.")), len(lines))
    keys = lines[:start]
    for key, value in (settings or {}).items():
        keys = [line for line in keys if not line.startswith(f"{key} = ")]
        keys.append(f"{key} = {json.dumps(value)}")  # JSON's strings, numbers, booleans and lists are TOML's
    return "\n".join(keys + lines[start:]) + "\n"


# Engines whose weights_path is a folder: a hub variant lists the folder's files one by one, and
# the block names the folder that holds its weights file.
FOLDER_ENGINES = frozenset({"ggml_whisper"})


def weights_path(entry: CatalogEntry, weights: CatalogFile) -> str:
    """The config block's weights_path for the variant's weights file: its `local`, or for an
    engine that reads a folder and a file fetched alone, the folder around it."""
    if entry.engine in FOLDER_ENGINES and weights.repo is not None:
        return str(PurePosixPath(weights.local).parent)
    return weights.local


def _block_lines(entry: CatalogEntry, variant: CatalogVariant, weights: CatalogFile) -> list[str]:
    converted = bool(weights.package_path and weights.local.endswith(".gguf"))
    lines = [
        f"# {entry.name} ({variant.quant}), {entry.publisher}, license {entry.license}.",
        *(
            [f"# The GGUF is converted from the package's {weights.package_path}/ folder by manage.py convertmodels."]
            if converted
            else []
        ),
        "[[models]]",
        f'id = "{entry.id}"',
        f'modality = "{entry.modality}"',
        f'engine = "{entry.engine}"',
        f'weights_path = "{weights_path(entry, weights)}"',
        f"context_len = {variant.context_len}",
    ]
    if weights.package:
        lines.append(f'package = "{weights.package.split("==")[0]}"')
    if weights.parts:
        lines.append(f"package_parts = {weights.parts}")
    if variant.sha256:
        lines.append(f'sha256 = "{variant.sha256}"')
    if variant.tool_router:
        lines.append("tool_router = true")
    served = [m for m in entry.additional_modalities if m == "entity_extraction" and entry.engine == "ggml_llama"]
    if served:
        # A chat model that extracts entities (/v1/entities through a JSON-schema grammar).
        lines.append(f"additional_modalities = {json.dumps(served)}")
    if weights.package_path:
        lines.append(f'package_path = "{weights.package_path}"')
    if entry.aliases:
        lines.append(f"aliases = {json.dumps(entry.aliases)}")
    aux = next((f for f in variant.files if f.role == "aux"), None)
    if aux is not None:
        # A projector (vision) for a llama.cpp model; a VAE for an image model.
        lines.append(f'aux_path = "{aux.local}"')
    if entry.engine == "ggml_llama":
        # Checked against the GGUF when the block joins a running pool (POST /v1/models).
        lines += ["[models.arch]", f'architecture = "{entry.architecture}"']
    if variant.image is not None:
        lines += _image_lines(variant.image)
    return lines


def _image_lines(image: ImageConfig) -> list[str]:
    """[models.image] with the keys the catalog sets (the rest keep ImageConfig's defaults)."""
    settings = image.model_dump(exclude_unset=True)
    encoders = settings.pop("text_encoders", {})
    lines = ["[models.image]", *(f"{key} = {json.dumps(value)}" for key, value in settings.items())]
    if encoders:
        lines += ["[models.image.text_encoders]", *(f"{role} = {json.dumps(path)}" for role, path in encoders.items())]
    return lines


def _runs(entry: CatalogEntry, variant: CatalogVariant, configured: str) -> bool:
    """Whether a model block's weights_path is this variant's: the path its config block writes,
    or a file of the variant by name (a block that places the file elsewhere)."""
    weights = next((f for f in variant.files if f.role == "weights"), None)
    if weights is not None and weights_path(entry, weights) == configured:
        return True
    return any(f.local == Path(configured).name for f in variant.files)


def _file_state(config: HypnosConfig, file: CatalogFile) -> dict[str, Any]:
    path = config.models_dir / file.local
    present = is_present(path)
    dumped = file.model_dump(exclude=None if file.gated else {"gated"})
    # `size` stays in the answer as null when unknown, so every file has the same keys.
    shown = {key: value for key, value in dumped.items() if value is not None or key == "size"}
    # Without a listed size there is nothing to call a present file outdated against.
    outdated = present and file.size is not None and disk_size(path) != file.size
    return {**shown, "present": present, "outdated": outdated}


def is_present(path: Path) -> bool:
    """On disk: a file, or a folder that is not empty."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def variant_size(variant: CatalogVariant) -> int | None:
    """The bytes of the variant's files; None when the catalog does not know one file's size."""
    sizes = [f.size for f in variant.files]
    return None if None in sizes else sum(s for s in sizes if s is not None)


def disk_size(path: Path) -> int:
    """A file's size; a folder's: the sum of the files inside it."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _problem(config: HypnosConfig, entry: CatalogEntry, variant: CatalogVariant) -> dict[str, str]:
    """`problem` when the downloaded weights' GGUF reports another architecture than the entry."""
    weights = next((f for f in variant.files if f.role == "weights"), None)
    path = config.models_dir / weights.local if weights else None
    if entry.engine != "ggml_llama" or path is None or not path.is_file():
        return {}
    try:
        found = read_gguf(path).architecture
    except (GgufError, OSError) as exc:
        return {"problem": f"{weights.local} is not a readable GGUF file: {exc}"}  # type: ignore[union-attr]
    if found != entry.architecture:
        return {"problem": f"{weights.local} reports the architecture {found!r}, not {entry.architecture!r}"}  # type: ignore[union-attr]
    return {}


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
            variants.append(
                {
                    **variant.model_dump(exclude={"files", "sha256", "tool_router", "estimate", "image"}),
                    "size_bytes": variant_size(variant),
                    "files": files,
                    "installed": all(f["present"] for f in files),
                    "outdated": any(f["outdated"] for f in files),
                    "config_block": config_block(entry, variant),
                    **_problem(config, entry, variant),
                }
            )
        model = configured.get(entry.id)
        row = {
            **entry.model_dump(exclude={"variants"}),
            "configured": model is not None,
            "enabled": bool(model and model.enabled),
            "variants": variants,
        }
        if model is not None:
            runs = (v.quant for v in entry.variants if _runs(entry, v, model.weights_path))
            row["configured_quant"] = next(runs, None)
        data.append(row)
    return {
        "object": "list",
        "catalog_version": catalog.catalog_version,
        "models_dir": str(config.models_dir),
        "tested_architectures": catalog.tested_architectures,
        "data": data,
    }
