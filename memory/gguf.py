"""Read what the planner needs from a GGUF header: scalar metadata and every tensor's size.

gguf's own `GGUFReader` decodes every array (a 49k-token vocabulary takes it ~8 s); this
reader walks the same format but skips arrays, so a header is read in milliseconds. The
quantization block sizes come from the `gguf` package (llama.cpp's own table).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


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

    def skip_string(self) -> None:
        self.pos += 8 + int(struct.unpack_from("<Q", self.buf, self.pos)[0])

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.uint("I"), self.uint("Q")
            if item_type == _STRING:
                for _ in range(count):
                    self.skip_string()
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
