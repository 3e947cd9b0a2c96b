"""The catalog and the default lineup (DEFAULT_MODELS of hypnos_site/config.py): every model a
fresh box serves is a catalog entry marked `lineup`, whose default variant runs the same files,
and every catalog file says where it comes from (issue 34). No database, no model file."""

from __future__ import annotations

import tomllib

import pytest

from hypnos_site.config import BASE_DIR, DEFAULT_MODELS, ModelConfig
from models_registry.catalog import CatalogFile, config_block, find_variant, load_catalog

CATALOG = load_catalog(BASE_DIR / "models.catalog.toml")
ENTRIES = {e.id: e for e in CATALOG.models}
FILES = [(f"{e.id}:{v.quant}:{f.local}", f) for e in CATALOG.models for v in e.variants for f in v.files]
# The keys of a model block that name its files and how they are placed.
FILE_KEYS = ("weights_path", "package", "package_parts", "package_path", "sha256", "aux_path")


def pinned_model_packages() -> set[str]:
    """The `name==version` lines of requirements/models-cpu.txt, which ./run.sh setup installs."""
    lines = (BASE_DIR / "requirements" / "models-cpu.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def package_specs(file: CatalogFile) -> list[str]:
    assert file.package is not None
    return [file.package.format(i) for i in range(1, file.parts + 1)] if file.parts else [file.package]


@pytest.mark.parametrize("model", DEFAULT_MODELS, ids=[m.id for m in DEFAULT_MODELS])
def test_every_model_of_the_default_lineup_is_a_lineup_entry_of_the_catalog(model):
    entry = ENTRIES.get(model.id)
    assert entry is not None, f"{model.id} is in DEFAULT_MODELS, not in models.catalog.toml"
    assert (entry.modality, entry.engine) == (model.modality, model.engine)
    # The CPU lineup: the advisor proposes it on a machine without a GPU too.
    assert entry.lineup is True and entry.gpu is False


@pytest.mark.parametrize("model", DEFAULT_MODELS, ids=[m.id for m in DEFAULT_MODELS])
def test_the_default_variant_runs_the_files_the_default_lineup_runs(model):
    entry, variant = find_variant(CATALOG, model.id)
    [block] = tomllib.loads(config_block(entry, variant))["models"]
    runs = ModelConfig.model_validate(block)
    assert {key: getattr(runs, key) for key in FILE_KEYS} == {key: getattr(model, key) for key in FILE_KEYS}
    assert (runs.additional_modalities, runs.tool_router) == (model.additional_modalities, model.tool_router)
    # What GET /v1/models lists of an image model the catalog lists too (the advisor reads `upscale`).
    assert set(model.image_capabilities) <= set(entry.capabilities)


def test_the_catalog_marks_as_lineup_exactly_the_default_lineup():
    assert {e.id for e in CATALOG.models if e.lineup} == {m.id for m in DEFAULT_MODELS}


@pytest.mark.parametrize(("label", "file"), FILES, ids=[label for label, _ in FILES])
def test_every_catalog_file_comes_from_a_hub_or_a_pinned_package(label, file):
    # A packaged file has no repo or remote: `manage.py installmodels` finds it inside the
    # installed package (package_path), and no hub is asked for it.
    from_hub = file.repo is not None and file.remote is not None
    assert from_hub != (file.package is not None), label
    if file.package is not None:
        # Pinned as ./run.sh setup installs it, so the files placed are the bytes listed.
        assert set(package_specs(file)) <= pinned_model_packages(), label
        assert file.size is not None, f"{label}: a packaged file's size is known to the byte"
