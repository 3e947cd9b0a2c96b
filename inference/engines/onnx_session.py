"""What every engine on onnxruntime shares: the execution providers of this build, and a
session opened from the worker's warm copy with the engine's threads."""

from __future__ import annotations

from pathlib import Path

import onnxruntime

from hypnos_site.errors import ModelNotAvailable


def providers() -> list[str]:
    """CUDA when this onnxruntime build has it (onnxruntime-gpu on a GPU box), always CPU last."""
    available = onnxruntime.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def open_session(model_id: str, path: str, source: Path, n_threads: int | None) -> onnxruntime.InferenceSession:
    """A session on the graph at `path` (a warm copy's /proc/self/fd path); a graph onnxruntime
    cannot load is ModelNotAvailable naming `source`, the file it came from."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = n_threads or 0
    try:
        return onnxruntime.InferenceSession(path, sess_options=options, providers=providers())
    except Exception as exc:  # onnxruntime raises one plain Exception class per status (InvalidProtobuf...)
        raise ModelNotAvailable(f"model {model_id!r} could not be loaded from {source}: {exc}") from exc
