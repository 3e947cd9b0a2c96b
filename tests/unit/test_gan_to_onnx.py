"""models_registry/gan_to_onnx.py on files the tests write in torch.save's zip layout (no torch
here): the restricted unpickler, the tensors it rebuilds, the graph it builds. The real
package's weights are converted in tests/integration/test_image_onnx_engine.py."""

from __future__ import annotations

import io
import os
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

from models_registry.gan_to_onnx import (
    ConversionError,
    Storage,
    UnsafePickle,
    _rebuild_tensor,
    convert_dcgan,
    read_state_dict,
)

NZ, NGF = 8, 2  # a tiny generator of models.py's architecture: nz 8, ngf 2, 3 channels


class TorchPickle:
    """Writes the protocol-2 pickle torch.save puts in data.pkl, opcode by opcode (torch is not
    installed, so its globals cannot be pickled by reference): {key: OrderedDict(name: tensor)},
    each tensor a `_rebuild_tensor_v2` of a persistent ("storage", ...) id."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.storages: dict[str, bytes] = {}

    def op(self, code: bytes, payload: bytes = b"") -> None:
        self.out.write(code + payload)

    def global_(self, module: str, name: str) -> None:
        self.op(pickle.GLOBAL, f"{module}\n{name}\n".encode())

    def string(self, text: str) -> None:
        data = text.encode()
        self.op(pickle.BINUNICODE, struct.pack("<I", len(data)) + data)

    def int_(self, value: int) -> None:
        self.op(pickle.BININT, struct.pack("<i", value))

    def ints(self, values: tuple[int, ...]) -> None:
        self.op(pickle.MARK)
        for v in values:
            self.int_(v)
        self.op(pickle.TUPLE)

    def ordered_dict(self) -> None:
        self.global_("collections", "OrderedDict")
        self.op(pickle.EMPTY_TUPLE)
        self.op(pickle.REDUCE)

    def tensor(self, array: np.ndarray, storage_type: str = "FloatStorage") -> None:
        # Stored transposed-and-back, so the rebuild has to follow real (non-trivial) strides.
        key = str(len(self.storages))
        flat = np.ascontiguousarray(array.T).reshape(-1)
        self.storages[key] = flat.astype("<f4").tobytes()
        strides = tuple(int(s) // 4 for s in np.ascontiguousarray(array.T).T.strides)
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.op(pickle.MARK)
        self.op(pickle.MARK)
        self.string("storage")
        self.global_("torch", storage_type)
        self.string(key)
        self.string("cpu")
        self.int_(flat.size)
        self.op(pickle.TUPLE)
        self.op(pickle.BINPERSID)
        self.int_(0)
        self.ints(array.shape)
        self.ints(strides)
        self.op(pickle.NEWFALSE)
        self.ordered_dict()
        self.op(pickle.TUPLE)
        self.op(pickle.REDUCE)

    def state_dict(self, state: dict[str, np.ndarray], key: str = "netG_state_dict") -> bytes:
        self.op(pickle.PROTO, b"\x02")
        self.op(pickle.EMPTY_DICT)
        self.string(key)
        self.ordered_dict()
        self.op(pickle.MARK)
        for name, array in state.items():
            self.string(name)
            self.tensor(array)
        self.op(pickle.SETITEMS)
        self.op(pickle.SETITEM)
        self.op(pickle.STOP)
        return self.out.getvalue()


def write_archive(path: Path, data_pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("weights/data.pkl", data_pkl)
        archive.writestr("weights/byteorder", "little")
        for key, raw in (storages or {}).items():
            archive.writestr(f"weights/data/{key}", raw)
        archive.writestr("weights/version", "3\n")
    return path


def tiny_state(seed: int = 0) -> dict[str, np.ndarray]:
    """A random state dict with models.py's keys and shapes for nz 8, ngf 2."""
    rng = np.random.default_rng(seed)
    channels = [NZ, 8 * NGF, 4 * NGF, 2 * NGF, NGF, 3]
    state: dict[str, np.ndarray] = {}
    for i, index in enumerate((0, 3, 6, 9, 12)):
        state[f"main.{index}.weight"] = rng.normal(0, 0.3, (channels[i], channels[i + 1], 4, 4)).astype(np.float32)
        if index != 12:
            c = channels[i + 1]
            state[f"main.{index + 1}.weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
            state[f"main.{index + 1}.bias"] = rng.normal(0, 0.1, c).astype(np.float32)
            state[f"main.{index + 1}.running_mean"] = rng.normal(0, 0.1, c).astype(np.float32)
            state[f"main.{index + 1}.running_var"] = rng.uniform(0.5, 2.0, c).astype(np.float32)
    return state


def tiny_checkpoint(path: Path, state: dict[str, np.ndarray] | None = None) -> Path:
    writer = TorchPickle()
    data = writer.state_dict(state if state is not None else tiny_state())
    return write_archive(path, data, writer.storages)


class CallsSystem:
    """Pickles as a call of os.system, the classic malicious pickle."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


def test_it_reads_the_tensors_with_their_strides(tmp_path: Path) -> None:
    state = tiny_state()
    read = read_state_dict(tiny_checkpoint(tmp_path / "weights.tar", state))
    assert list(read) == list(state)
    for name, array in state.items():
        assert read[name].dtype == np.float32 and read[name].flags.c_contiguous
        np.testing.assert_array_equal(read[name], array)


def test_it_refuses_a_pickle_that_calls_os_system(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"netG_state_dict": CallsSystem(f"touch {marker}")}, protocol=2)
    path = write_archive(tmp_path / "weights.tar", data)
    with pytest.raises(UnsafePickle, match=r"global (os|posix)\.system"):
        read_state_dict(path)
    assert not marker.exists()


def test_it_refuses_any_other_global_even_inside_a_valid_state_dict(tmp_path: Path) -> None:
    writer = TorchPickle()
    writer.op(pickle.PROTO, b"\x02")
    writer.op(pickle.EMPTY_DICT)
    writer.string("netG_state_dict")
    writer.global_("builtins", "eval")
    writer.string("1 + 1")
    writer.op(pickle.TUPLE1)
    writer.op(pickle.REDUCE)
    writer.op(pickle.SETITEM)
    writer.op(pickle.STOP)
    with pytest.raises(UnsafePickle, match=r"builtins\.eval"):
        read_state_dict(write_archive(tmp_path / "weights.tar", writer.out.getvalue()))


def test_it_refuses_a_storage_type_called_as_a_function(tmp_path: Path) -> None:
    writer = TorchPickle()
    writer.op(pickle.PROTO, b"\x02")
    writer.global_("torch", "FloatStorage")
    writer.op(pickle.EMPTY_TUPLE)
    writer.op(pickle.REDUCE)
    writer.op(pickle.STOP)
    with pytest.raises(ConversionError, match="malformed"):
        read_state_dict(write_archive(tmp_path / "weights.tar", writer.out.getvalue()))


def test_it_refuses_a_tensor_reaching_past_its_storage() -> None:
    storage = Storage(np.zeros(12, np.float32))
    assert _rebuild_tensor(storage, 2, (2, 5), (5, 1)).array.shape == (2, 5)
    with pytest.raises(UnsafePickle, match="reaches element 12"):
        _rebuild_tensor(storage, 3, (2, 5), (5, 1))
    with pytest.raises(UnsafePickle, match="impossible geometry"):
        _rebuild_tensor(storage, 0, (2, 5), (-5, 1))


def test_it_refuses_a_storage_larger_than_declared(tmp_path: Path) -> None:
    writer = TorchPickle()
    data = writer.state_dict(tiny_state())
    writer.storages["0"] += b"\0" * 4
    with pytest.raises(ConversionError, match="weights/data/0 holds"):
        read_state_dict(write_archive(tmp_path / "weights.tar", data, writer.storages))


def test_it_refuses_the_legacy_tar_format(tmp_path: Path) -> None:
    path = tmp_path / "weights.tar"
    with tarfile.open(path, "w") as archive:
        for member in ("sys_info", "pickle", "tensors", "storages"):
            info = tarfile.TarInfo(member)
            info.size = 1
            archive.addfile(info, io.BytesIO(b"\0"))
    with pytest.raises(ConversionError, match="legacy tar"):
        read_state_dict(path)


def test_it_refuses_a_state_dict_of_another_architecture(tmp_path: Path) -> None:
    state = tiny_state()
    state["main.13.weight"] = np.ones(3, np.float32)
    with pytest.raises(ConversionError, match=r"main\.13\.weight"):
        convert_dcgan(tiny_checkpoint(tmp_path / "weights.tar", state), tmp_path / "g.onnx")
    del state["main.13.weight"]
    state["main.3.weight"] = state["main.3.weight"][:, :, :3, :3]
    with pytest.raises(ConversionError, match=r"main\.3\.weight has shape"):
        convert_dcgan(tiny_checkpoint(tmp_path / "weights.tar", state), tmp_path / "g.onnx")


def test_the_graph_maps_a_batch_of_latents_to_64x64_rgb(tmp_path: Path) -> None:
    dest = tmp_path / "g.onnx"
    convert_dcgan(tiny_checkpoint(tmp_path / "weights.tar"), dest)
    model = onnx.load(dest)
    onnx.checker.check_model(model, full_check=True)
    (z,), (img,) = model.graph.input, model.graph.output

    def dims(value: onnx.ValueInfoProto) -> list[str | int]:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    assert (z.name, dims(z), img.name, dims(img)) == ("z", ["n", NZ, 1, 1], "img", ["n", 3, 64, 64])
    assert [n.op_type for n in model.graph.node] == [
        *["ConvTranspose", "BatchNormalization", "Relu"] * 4,
        "ConvTranspose",
        "Tanh",
    ]
    session = onnxruntime.InferenceSession(str(dest), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"z": np.random.default_rng(1).standard_normal((3, NZ, 1, 1), dtype=np.float32)})
    assert out.shape == (3, 3, 64, 64) and np.abs(out).max() <= 1.0
    assert not np.allclose(out[0], out[1])


def test_the_conversion_is_deterministic(tmp_path: Path) -> None:
    source = tiny_checkpoint(tmp_path / "weights.tar")
    convert_dcgan(source, tmp_path / "a" / "g.onnx")
    convert_dcgan(source, tmp_path / "b" / "g.onnx")
    assert (tmp_path / "a" / "g.onnx").read_bytes() == (tmp_path / "b" / "g.onnx").read_bytes()
    assert not list(tmp_path.rglob("*.part"))
