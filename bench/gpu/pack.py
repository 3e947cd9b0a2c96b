"""`./run.sh gpu-pack`: fill `.gpu/` (git-ignored) with what a bare, offline GPU machine needs to
run `./run.sh gpu-check`, check that it travels, and print the device command.

What may travel: the working tree plus at most 8 ignored paths, 64 MiB in all. So `.gpu/` holds
- llama-cpp-python's sdist, trimmed: PyPI's is 73 MiB, most of it vendored llama.cpp's vocabulary
  GGUFs, docs, git objects and the web UI's sources, none of which the build reads;
- the wheels (cp312, manylinux x86-64) of what the GPU tests import and the device's python3
  lacks: the gguf package, pydantic and Django's stack (inference/engines/llama.py imports
  hypnos_site.config and hypnos_site.errors), pillow, diskcache; versions as in this venv;
- `cache/`: the parts of a CUDA build bundle a previous device run returned (--cache), when
  there is one; then the sdist is left out if both do not fit;
- `manifest.json`: every file and its size, and the measured sizes of what cannot travel.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.gpu import bundle

ROOT = Path(__file__).resolve().parents[2]
CARRY_LIMIT = 64 * 2**20
# The imports of the GPU tests that the device's python3 lacks; their requirements follow.
ROOTS = ["gguf", "diskcache", "pydantic", "Django", "djangorestframework", "celery", "pillow", "tqdm"]
# On the device's python3 already (issue 20): never carried.
ON_DEVICE = {
    "numpy", "jinja2", "markupsafe", "psutil", "pyyaml", "requests", "urllib3", "idna", "certifi",
    "charset-normalizer", "typing-extensions", "packaging", "nvidia-ml-py", "pytest", "pytest-timeout",
}  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# Paths of the sdist no build reads: vendored llama.cpp's vocabulary GGUFs and test inputs,
# docs (3 MiB CSV tables each), git objects, benches, the web UI's sources (llama-server is
# built without its UI), gguf-py (carried as the gguf wheel), and backends other than CPU and CUDA.
SDIST_DROP = re.compile(
    r"^[^/]+/(\.git(/|$)|examples/notebooks/|vendor/llama\.cpp/(models/|docs/|benches/|media/|\.github/|"
    r"\.devops/|tests/|gguf-py/|tools/ui/(src|tests|static)/|ggml/src/ggml-(opencl|vulkan|sycl|cann|"
    r"hexagon|metal|webgpu|zdnn|musa|hip|openvino|zendnn|virtgpu)/))"
)
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """normalized name -> installed version for `roots` and what they require (no extras) under
    Python 3.12 on Linux, minus what the device has."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(python_version="3.12", python_full_version="3.12.3")
    env.update(sys_platform="linux", extra="")
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = normalize(todo.pop())
        if name in found or name in ON_DEVICE:
            continue
        found[name] = metadata.version(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(found.items()))


def download_wheels(packages: dict[str, str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", "3.12", "--implementation", "cp", *platforms]
    subprocess.run([*cmd, *(f"{n}=={v}" for n, v in packages.items())], check=True)


def slim_sdist(source: Path, dest: Path) -> dict[str, int]:
    """Copy the sdist without SDIST_DROP's paths; bytes kept and dropped (uncompressed)."""
    kept = dropped = 0
    with tarfile.open(source) as src, tarfile.open(dest, "w:gz", compresslevel=9) as out:
        for member in src:
            if SDIST_DROP.match(member.name):
                dropped += member.size
                continue
            kept += member.size
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    return {"kept_bytes": kept, "dropped_bytes": dropped}


def fetch_sdist(version: str, cache: Path) -> Path:
    """PyPI's sdist of llama-cpp-python `version`, downloaded once into `cache`."""
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", str(cache)]
        subprocess.run([*cmd, f"llama-cpp-python=={version}"], check=True)
    return sdist


def tree_bytes(root: Path = ROOT) -> int:
    """The working tree as the device receives it: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [root / p.decode() for p in listed if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def manifest(carry: Path, tree: int) -> dict[str, Any]:
    """Every file under `carry` (the manifest itself aside) with its size, and the totals."""
    files = {
        str(p.relative_to(carry)): p.stat().st_size
        for p in sorted(carry.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    total = tree + sum(files.values())
    return {
        "files": files,
        "carry_bytes": sum(files.values()),
        "tree_bytes": tree,
        "total_bytes": total,
        "limit_bytes": CARRY_LIMIT,
        "fits": total <= CARRY_LIMIT,
    }


def registry_size(name: str, version: str, want: str) -> tuple[str, int] | None:
    """(file name, bytes) of the first file of `name` `version` on PyPI whose name matches
    `want` (a regular expression), from PyPI's JSON simple API (the index pip reads)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{normalize(name)}/", headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.loads(response.read())["files"]
    for f in files:
        if f"-{version}" in f["filename"] and re.search(want, f["filename"]):
            return f["filename"], int(f["size"])
    return None


CP312 = r"cp312-cp312-manylinux.*x86_64\.whl$"
ABI3 = r"abi3-manylinux.*x86_64\.whl$"
NOT_CARRIED = {
    "onnxruntime-gpu": [("onnxruntime-gpu", CP312)],
    "cuda-whisper": [
        ("ctranslate2", CP312),
        ("faster-whisper", r"py3-none-any\.whl$"),
        ("av", ABI3),
        ("tokenizers", ABI3),
    ],
    "sd-cpp-cuda": [("stable-diffusion-cpp-python", r"\.tar\.gz$")],
}


def not_carried_sizes(pins: dict[str, str]) -> dict[str, Any]:
    """For each GPU path that cannot travel, its files on PyPI and their MiB (measured now)."""
    sizes: dict[str, Any] = {}
    for path, files in NOT_CARRIED.items():
        found = {}
        for name, pattern in files:
            hit = registry_size(name, pins[name], pattern) if name in pins else None
            if hit is not None:
                found[hit[0]] = round(hit[1] / 2**20, 1)
        total = round(sum(found.values()), 1)
        sizes[path] = {
            "files_mib": found,
            "detail": f"{' + '.join(f'{n} {m} MiB' for n, m in found.items())} = {total} MiB" if found else "",
        }
    sizes["cuda-whisper"]["detail"] += "; plus a Whisper model (tiny.en: ~75 MiB)"
    return sizes


def pins() -> dict[str, str]:
    """name -> version from requirements/*.txt (`name==version` lines, `# name==version` too),
    and SDCPP_VERSION from run.sh for stable-diffusion-cpp-python."""
    found: dict[str, str] = {}
    for req in sorted((ROOT / "requirements").glob("*.txt")):
        for name, version in re.findall(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][A-Za-z0-9.+!]*)", req.read_text()):
            found.setdefault(normalize(name), version)
    sdcpp = re.search(r"^SDCPP_VERSION=(\S+)", (ROOT / "run.sh").read_text(), re.M)
    if sdcpp:
        found["stable-diffusion-cpp-python"] = sdcpp.group(1)
    return found


def device_command(carry: Path) -> str:
    relative = carry.resolve().relative_to(ROOT)
    return (
        f'run(command="./run.sh gpu-check \\"$OUT\\"", carry=["{relative}"], timeout_s=600)\n'
        f"  then keep the returned llama-cuda-*.tar.part* files and pass their folder to the next\n"
        f"  ./run.sh gpu-pack --cache <files_at> (see docs/gpu.md)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carry", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--version", required=True, help="llama-cpp-python's version (run.sh LLAMA_VERSION)")
    parser.add_argument("--cache", type=Path, help="a folder with the bundle parts a device run returned")
    parser.add_argument("--download-cache", type=Path, default=Path.home() / ".cache" / "hypnos" / "gpu-pack")
    parser.add_argument("--offline", action="store_true", help="no registry look-ups of the not-carried sizes")
    args = parser.parse_args(argv)
    carry: Path = args.carry
    shutil.rmtree(carry, ignore_errors=True)
    (carry / "wheels").mkdir(parents=True)
    packages = closure(ROOTS)
    download_wheels(packages, carry / "wheels")
    sdist = fetch_sdist(args.version, args.download_cache)
    trimmed = slim_sdist(sdist, carry / sdist.name)
    if args.cache is not None:
        for parts in bundle.find_parts(args.cache).values():
            for part in parts:
                (carry / "cache").mkdir(exist_ok=True)
                shutil.copy(part, carry / "cache" / part.name)
    tree = tree_bytes()
    result = manifest(carry, tree)
    if not result["fits"] and (carry / "cache").is_dir():
        # A cached build replaces the compile: the sdist is only needed without one.
        (carry / sdist.name).unlink()
        result = manifest(carry, tree)
    result["wheels"] = packages
    result["sdist"] = {"name": sdist.name, "pypi_bytes": sdist.stat().st_size, **trimmed}
    result["not_carried"] = {} if args.offline else not_carried_sizes(pins())
    (carry / "manifest.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2))
    mib = result["total_bytes"] / 2**20
    print(f"\n{carry}: {result['carry_bytes'] / 2**20:.1f} MiB; with the working tree {mib:.1f} MiB of 64 MiB")
    if not result["fits"]:
        print("too large to carry: the device run would not start", file=sys.stderr)
        return 1
    print("device run:\n  " + device_command(carry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
