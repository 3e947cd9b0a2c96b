"""Read what the planner needs from a GGUF header: scalar metadata and every tensor's size.

gguf's own `GGUFReader` decodes every array (a 49k-token vocabulary takes it ~8 s); this
reader walks the same format but skips arrays, so a header is read in milliseconds. The
quantization block sizes come from the `gguf` package (llama.cpp's own table).

A file is read once per version of it: the advisor, the pool's checks and the model listings
ask for the same headers on every request, and walking a 151,936-string vocabulary costs ~60 ms
(Qwen2.5). A version is the file's resolved path, size, mtime and inode, so a file replaced or
rewritten is read again; each caller gets its own copy of the containers.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# Headers kept (read_gguf): one per file version, a few kB of scalars and tensor sizes each.
CACHED_HEADERS = 128


class GgufError(ValueError):
    pass


@dataclass
class GgufTensor:
    name: str
    n_bytes: int


@dataclass
class GgufInfo:
    metadata: dict[str, object]
    tensors: list[GgufTensor] = field(default_factory=list)
    # Arrays are skipped, only their lengths kept (the vocabulary size, for one).
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_int(self, key: str, default: int = 0) -> int:
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        return int(value) if isinstance(value, (int, float)) else default


class _ArrayLength(int):
    pass


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> object:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def uint(self, fmt: str) -> int:
        """An unsigned integer field ("I" or "Q"), which struct unpacks as an int."""
        value = self.take(fmt)
        assert isinstance(value, int)
        return value

    def string(self) -> str:
        length = self.uint("Q")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.uint("I"), self.uint("Q")
            if item_type == _STRING:
                self.skip_strings(count)
            elif item_type in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item_type])
            else:
                raise GgufError(f"nested GGUF arrays (type {item_type}) are not supported")
            return _ArrayLength(count)
        raise GgufError(f"unknown GGUF value type {vtype}")


def tensor_bytes(ggml_type: int, dims: list[int]) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    elements = 1
    for d in dims:
        elements *= d
    return elements // block * type_size


def read_gguf(path: str | Path) -> GgufInfo:
    """Scalar metadata (arrays skipped) and the byte size of every tensor of a GGUF file."""
    resolved = os.path.realpath(path)
    stat = os.stat(resolved)
    info = _read_version(resolved, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    return GgufInfo(dict(info.metadata), list(info.tensors), dict(info.array_lengths))


@functools.lru_cache(maxsize=CACHED_HEADERS)
def _read_version(path: str, size: int, mtime_ns: int, inode: int) -> GgufInfo:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise GgufError(f"{path} is not a GGUF file")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            raise GgufError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = cur.uint("Q"), cur.uint("Q")
        info = GgufInfo({})
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.uint("I"))
            if isinstance(value, _ArrayLength):
                info.array_lengths[key] = int(value)
            else:
                info.metadata[key] = value
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.uint("I")
            dims = [cur.uint("Q") for _ in range(n_dims)]
            ggml_type = cur.uint("I")
            cur.take("Q")  # offset
            info.tensors.append(GgufTensor(name, tensor_bytes(ggml_type, dims)))
        return info
