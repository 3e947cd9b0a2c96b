"""Model files that come inside registry packages (no hub is reachable): find them in the
installed package without importing it, and place them under models_dir once per machine."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from hypnos_site.config import HypnosConfig, ModelConfig


class PackageMissing(Exception):
    pass


def package_file(model: ModelConfig) -> Path:
    """The weights file inside the model's installed package (located with find_spec, because
    importing such packages drags in their unrelated dependencies)."""
    assert model.package, f"{model.id} names no package"
    module = model.package.split("==")[0].replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing(f"{model.id}: the package {model.package} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    name = Path(model.weights_path).name
    found = next(iter(sorted(root.rglob(name))), None)
    if found is None:
        raise PackageMissing(f"{model.id}: {name} is not inside {root}")
    return found


def place(source: Path, dest: Path) -> bool:
    """Copy `source` to `dest` unless an identical-size copy is there; True when it copied.
    The copy goes through a temporary name, so an interrupted run leaves no half file."""
    if dest.exists() and dest.stat().st_size == source.stat().st_size:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
    return True


def install_packaged_models(config: HypnosConfig) -> list[tuple[str, Path, bool]]:
    placed = []
    for model in config.models:
        if model.package:
            dest = config.weights_file(model)
            placed.append((model.id, dest, place(package_file(model), dest)))
    return placed
