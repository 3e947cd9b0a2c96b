"""The CUDA build's cache bundle: the wheel and `llama-server`, packed in one tar and cut into
parts small enough to come back from the device machine.

What comes back from a device run is at most 8 files of at most 16 MiB each (64 MiB together),
and a CUDA wheel of llama-cpp-python is larger than 16 MiB; so the build is packed in one tar
with a manifest (the files' SHA-256, the build key) and split into 15 MiB parts
(`<stem>.tar.part00`, `.part01`, ...). The next run's cache step joins the parts in order,
checks every digest and the key, and installs the wheel instead of compiling for minutes.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

PART_BYTES = 15 * 2**20
MANIFEST = "manifest.json"
SUFFIX = ".tar.part"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_key(version: str, cmake_args: str, arch: str) -> str:
    """What a cached build must match: the package version, its CMake flags, the GPU arch."""
    return hashlib.sha256(f"{version}|{cmake_args}|{arch}".encode()).hexdigest()[:12]


def pack(files: list[Path], key: str, out_dir: Path, stem: str, part_bytes: int = PART_BYTES) -> list[Path]:
    """`files` in one tar with a manifest, written as parts of at most `part_bytes` into
    `out_dir`; the parts' paths in order."""
    manifest = {"key": key, "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in files}}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:  # wheels are zip-compressed already
        raw = json.dumps(manifest, indent=2).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for f in files:
            tar.add(f, arcname=f.name)
    data = buffer.getvalue()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        part = out_dir / f"{stem}{SUFFIX}{i:02d}"
        part.write_bytes(data[start : start + part_bytes])
        parts.append(part)
    return parts


def find_parts(folder: Path) -> dict[str, list[Path]]:
    """The bundles in `folder`: stem -> its parts in order."""
    bundles: dict[str, list[Path]] = {}
    for part in sorted(folder.glob(f"*{SUFFIX}*")) if folder.is_dir() else []:
        bundles.setdefault(part.name.rpartition(SUFFIX)[0], []).append(part)
    return bundles


def unpack(parts: list[Path], key: str, dest: Path) -> dict[str, Path]:
    """Join `parts`, check the manifest's key and every file's digest, extract into `dest`;
    name -> path. ValueError for a bundle of another build or a damaged one."""
    numbers = [int(p.name.rpartition(SUFFIX)[2]) for p in parts]
    if numbers != list(range(len(parts))):
        raise ValueError(f"bundle parts missing or out of order: {[p.name for p in parts]}")
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        member = tar.extractfile(MANIFEST)
        if member is None:
            raise ValueError("the bundle has no manifest")
        manifest = json.loads(member.read())
        if manifest["key"] != key:
            raise ValueError(f"the bundle is of build {manifest['key']}, this run needs {key}")
        dest.mkdir(parents=True, exist_ok=True)
        found = {}
        for name, meta in manifest["files"].items():
            source = tar.extractfile(name)
            if source is None:
                raise ValueError(f"the bundle lacks {name}")
            path = dest / name
            path.write_bytes(source.read())
            if path.stat().st_size != meta["bytes"] or sha256(path) != meta["sha256"]:
                raise ValueError(f"{name} in the bundle does not match its manifest")
            found[name] = path
    return found
