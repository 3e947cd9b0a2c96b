"""What a model must pass to join the pool at run time (spec §6, POST/PUT /v1/models): the body
read as one [[models]] block, from the catalog or as TOML, and the startup checks."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

from pydantic import ValidationError

from hypnos_site.config import ArchConfig, HypnosConfig, ModelConfig
from memory.gguf import GgufError, read_gguf
from models_registry.catalog import Catalog, UnknownSpec, config_block, find_variant

log = logging.getLogger(__name__)


class PoolCheckFailed(ValueError):
    """The model cannot join the pool; `reasons` says every reason found."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def block_from_catalog(catalog: Catalog | None, spec: str) -> str:
    """The [[models]] TOML of a catalog spec `<id>[:<quant>]`."""
    if catalog is None:
        raise PoolCheckFailed(["this server has no models.catalog.toml"])
    try:
        return config_block(*find_variant(catalog, spec))
    except UnknownSpec as exc:
        raise PoolCheckFailed([str(exc)]) from exc


def model_from_block(text: str, model_id: str | None = None) -> ModelConfig:
    """One [[models]] block (TOML) as a validated ModelConfig; `model_id` overrides its id."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PoolCheckFailed([f"config is not valid TOML: {exc}"]) from exc
    blocks = raw.get("models")
    if set(raw) != {"models"} or not isinstance(blocks, list) or len(blocks) != 1:
        raise PoolCheckFailed(["config must hold exactly one [[models]] block and nothing else"])
    block = dict(blocks[0])
    if model_id is not None:
        block["id"] = model_id
    try:
        return ModelConfig.model_validate(block)
    except ValidationError as exc:
        raise PoolCheckFailed(
            [f"models.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        ) from exc


def check_model(config: HypnosConfig, model: ModelConfig, catalog: Catalog | None) -> ModelConfig:
    """The startup checks: files inside the allowed folders and, for llama.cpp models, a GGUF this
    build of llama.cpp loads (any architecture it knows; one outside the catalog's
    tested_architectures is logged as untested), [models.arch] agreeing with the file. Returns
    the model with the arch values it left out filled from the GGUF; raises PoolCheckFailed
    with every reason."""
    reasons: list[str] = []
    weights = _weights_inside(config, model, reasons)
    if weights is None or model.engine != "ggml_llama":
        if reasons:
            raise PoolCheckFailed(reasons)
        return model
    try:
        info = read_gguf(weights)
    except (GgufError, OSError) as exc:
        raise PoolCheckFailed([f"{model.weights_path} is not a readable GGUF file: {exc}"]) from exc
    found = ArchConfig(
        architecture=info.architecture or None,
        block_count=info.arch_int("block_count") or None,
        context_length=info.arch_int("context_length") or None,
        embedding_length=info.arch_int("embedding_length") or None,
    )
    for key, given in model.arch.model_dump(exclude_none=True).items():
        if given != getattr(found, key):
            reasons.append(f"[models.arch] {key} = {given!r}, but the GGUF reports {getattr(found, key)!r}")
    # Here, not at the top: the web process loads libllama only when a pool change asks it.
    from models_registry.llama_check import llama_cpp_refusal

    refusal = llama_cpp_refusal(weights)
    if refusal is not None:
        reasons.append(_refusal_reason(model, found.architecture, refusal))
    if reasons:
        raise PoolCheckFailed(reasons)
    if catalog is not None and found.architecture not in catalog.tested_architectures:
        # llama.cpp loads it, so it may serve; the catalog's tests never ran on it.
        log.warning(
            "model %s: architecture %r is not one of the catalog's tested_architectures (%s); llama.cpp loads it",
            model.id,
            found.architecture,
            ", ".join(catalog.tested_architectures),
        )
    return model.model_copy(update={"arch": found})


def _refusal_reason(model: ModelConfig, architecture: str | None, refusal: str) -> str:
    # llama.cpp's words for an architecture it has no code for: "unknown model architecture:
    # 'x'" (a name it has never heard of) and "unsupported model architecture: 'x'".
    if architecture and f"model architecture: '{architecture}'" in refusal:
        return f"the GGUF's architecture {architecture!r} is not one this build of llama.cpp knows ({refusal})"
    return f"llama.cpp cannot load {model.weights_path} ({refusal})"


def _weights_inside(config: HypnosConfig, model: ModelConfig, reasons: list[str]) -> Path | None:
    """The weights file, when it resolves (symlinks followed) inside models_dir or another
    folder the operator allows (server.model_paths, the Hugging Face cache)."""
    root = config.models_dir.resolve()
    path = config.weights_file(model).resolve()
    if not any(path.is_relative_to(folder) for folder in config.model_folders):
        allowed = ", ".join(str(folder) for folder in config.model_folders)
        reasons.append(f"weights_path {model.weights_path!r} is outside models_dir and server.model_paths ({allowed})")
        return None
    if not path.exists():
        reasons.append(
            f"weights_path {model.weights_path!r} does not exist in models_dir ({root}); "
            "./run.sh models <id>[:<quant>] downloads catalog models"
        )
        return None
    return path
