"""Model files that come inside registry packages (no hub is reachable): find them in the
installed package without importing it, and place them under models_dir once per machine."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from hypnos_site.config import HypnosConfig, ModelConfig


class PackageMissing(Exception):
    pass


def _package_root(model_id: str, package: str) -> Path:
    # Located with find_spec, not imported: such packages' __init__ drags in unrelated tools.
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing(f"{model_id}: the package {package} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def package_files(model: ModelConfig) -> list[Path]:
    """The file(s) inside the model's installed package(s) that make up its weights, in order."""
    assert model.package, f"{model.id} names no package"
    if model.package_parts:
        parts = []
        for i in range(1, model.package_parts + 1):
            root = _package_root(model.id, model.package.format(i))
            found = sorted(root.rglob("*.bin"))
            if len(found) != 1:
                raise PackageMissing(f"{model.id}: part {i} in {root} holds {len(found)} .bin files, not 1")
            parts.append(found[0])
        return parts
    root = _package_root(model.id, model.package)
    name = Path(model.weights_path).name
    found = sorted(root.rglob(name))
    if not found:
        raise PackageMissing(f"{model.id}: {name} is not inside {root}")
    return found[:1]


def place(sources: list[Path], dest: Path, sha256: str | None = None) -> bool:
    """Join `sources` into `dest` unless a file of the same size is there; True when it wrote.
    The bytes go through a temporary name and are checked against `sha256` before they take
    the real name, so an interrupted or corrupt run leaves no half file behind."""
    size = sum(p.stat().st_size for p in sources)
    if dest.exists() and dest.stat().st_size == size:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for source in sources:
            with open(source, "rb") as f:
                while chunk := f.read(8 << 20):
                    out.write(chunk)
                    digest.update(chunk)
    if sha256 and digest.hexdigest() != sha256:
        tmp.unlink()
        raise PackageMissing(f"{dest.name}: sha256 {digest.hexdigest()} is not the expected {sha256}")
    os.replace(tmp, dest)
    return True


def install_packaged_models(config: HypnosConfig) -> list[tuple[str, Path, bool]]:
    placed = []
    for model in config.models:
        if model.package:
            dest = config.weights_file(model)
            placed.append((model.id, dest, place(package_files(model), dest, model.sha256)))
    return placed
