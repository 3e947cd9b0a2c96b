"""MoE expert offload for llama.cpp (spec §6): the routed experts of chosen layers load into host
(CPU) buffers while the rest of each layer goes where `n_gpu_layers` puts it.

llama.cpp does this with tensor buffer-type overrides (`--override-tensor "blk\\.N\\.ffn_.*_exps\\.=CPU"`,
`llama_model_params.tensor_buft_overrides`). llama-cpp-python's `Llama()` has no argument for
them, but its `llama_model_params` carries the field (as a plain pointer) and the ggml library it
ships exports the CPU buffer type, so the list is built here with ctypes and set on the params
by `ExpertOffloadModel`, which `inference/engines/llama.py` installs in place of
`llama_cpp._internals.LlamaModel`.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from typing import Any, cast

import llama_cpp
import llama_cpp._internals as internals
from llama_cpp._ggml import libggml


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@cache
def cpu_buffer_type() -> int:
    """ggml's CPU buffer type: host memory, the buffer type llama.cpp's `=CPU` names."""
    fn = libggml.ggml_backend_cpu_buffer_type
    fn.restype, fn.argtypes = ctypes.c_void_p, []
    buft = fn()
    if not buft:
        raise RuntimeError("the ggml library has no CPU buffer type")
    return int(buft)


def expert_pattern(layers: range) -> str:
    """llama.cpp's regular expression for the routed expert tensors of `layers` (its own
    `ffn_.*_exps` pattern; shared experts, `ffn_*_shexp`, do not match)."""
    return r"^blk\.(" + "|".join(str(i) for i in layers) + r")\.ffn_[a-z_]*_exps\."


def cpu_overrides(patterns: list[str]) -> ctypes.Array[_BuftOverride]:
    """A NULL-terminated override list sending tensors that match any of `patterns` to host
    memory. The array (and the pattern bytes it points to) must outlive the model load."""
    entries = (_BuftOverride * (len(patterns) + 1))()
    for i, pattern in enumerate(patterns):
        entries[i].pattern, entries[i].buft = pattern.encode(), cpu_buffer_type()
    return entries


class ExpertOffloadModel(internals.LlamaModel):
    """`LlamaModel` that applies the host-memory overrides `request` set for this thread's load."""

    _load = threading.local()

    @classmethod
    def request(cls, patterns: list[str]) -> None:
        """Tensors matching `patterns` load into host memory at this thread's next model load
        (an empty list: none)."""
        cls._load.patterns = patterns

    def __init__(self, *args: Any, **kwargs: Any):
        patterns = getattr(ExpertOffloadModel._load, "patterns", [])
        params: llama_cpp.llama_model_params | None = kwargs.get("params")
        # Kept on the instance: llama.cpp reads the list during the load and keeps the pointer.
        self._buft_overrides = cpu_overrides(patterns) if patterns and params is not None else None
        if self._buft_overrides is not None and params is not None:
            # The field is a c_void_p (it takes an address); llama_cpp annotates it as the array.
            params.tensor_buft_overrides = cast(Any, ctypes.addressof(self._buft_overrides))
        super().__init__(*args, **kwargs)
