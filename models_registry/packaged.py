"""Model files that come inside registry packages (no hub is reachable): find them in the
installed package without importing it, and place them under models_dir once per machine."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
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
    if model.package_path:
        source = root / model.package_path
        if not source.exists():
            raise PackageMissing(f"{model.id}: {model.package_path} is not inside {root}")
        return [source]
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


def place_folder(source: Path, dest: Path) -> bool:
    """Copy the folder `source` to `dest` unless a folder with the same files (names and sizes)
    is there; True when it wrote. Written beside, then renamed into place."""
    wanted = {p.relative_to(source): p.stat().st_size for p in source.rglob("*") if p.is_file()}
    if dest.is_dir():
        have = {p.relative_to(dest): p.stat().st_size for p in dest.rglob("*") if p.is_file()}
        if have == wanted:
            return False
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return True


# What `torch.save` files are named in packages (gan-face-generate's is `weights.tar`).
TORCH_SAVE_SUFFIXES = (".tar", ".pt", ".pth")


def needs_conversion(model: ModelConfig) -> bool:
    """A packaged model served in another format than it comes in, which `manage.py
    convertmodels` writes once (installmodels leaves it alone): a Hugging Face folder served as
    GGUF, or a torch.save DCGAN generator (package_path ending in .tar, .pt, .pth) served as ONNX."""
    if not (model.package and model.package_path):
        return False
    if model.weights_path.endswith(".gguf"):
        return True
    return model.weights_path.endswith(".onnx") and model.package_path.endswith(TORCH_SAVE_SUFFIXES)


def convert_packaged_models(config: HypnosConfig) -> list[tuple[str, Path, bool]]:
    """Convert the packaged models that need it (needs_conversion) to their weights_path, once."""
    converted = []
    for model in config.models:
        if not needs_conversion(model):
            continue
        dest = config.weights_file(model)
        if dest.exists():
            converted.append((model.id, dest, False))
            continue
        (source,) = package_files(model)
        if dest.suffix == ".onnx":
            _convert_dcgan(model, source, dest)
        else:
            _convert_bert(model, source, dest)
        converted.append((model.id, dest, True))
    return converted


def _convert_bert(model: ModelConfig, source: Path, dest: Path) -> None:
    from models_registry.hf_to_gguf import ConversionError, convert_bert, is_hf_bert_folder

    if not is_hf_bert_folder(source):
        raise PackageMissing(f"{model.id}: {source} is not a BERT model folder with safetensors")
    try:
        convert_bert(source, dest, name=model.id)
    except ConversionError as exc:
        raise PackageMissing(str(exc)) from exc


def _convert_dcgan(model: ModelConfig, source: Path, dest: Path) -> None:
    # Imported here: onnx is a set-up dependency, not one of the web process.
    from models_registry.gan_to_onnx import ConversionError, convert_dcgan

    try:
        convert_dcgan(source, dest)
    except ConversionError as exc:
        raise PackageMissing(f"{model.id}: {exc}") from exc


def install_packaged_models(config: HypnosConfig) -> list[tuple[str, Path, bool]]:
    placed = []
    for model in config.models:
        if model.package and not needs_conversion(model):
            dest = config.weights_file(model)
            sources = package_files(model)
            if sources[0].is_dir():
                placed.append((model.id, dest, place_folder(sources[0], dest)))
            else:
                placed.append((model.id, dest, place(sources, dest, model.sha256)))
    return placed
