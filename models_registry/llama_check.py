"""Whether the built llama.cpp loads a GGUF (spec §6, the pool's startup checks): a vocab-only
load, which is llama.cpp's own check of the architecture and of the hyperparameters and
vocabulary it reads before any tensor. It reads no tensor and starts no device; what it takes
is building the vocabulary (about 60 ms for all-MiniLM's 30k tokens, 0.2 s for SmolLM2's 49k,
0.6 s for Qwen2.5's 151k on a busy two-core machine), once per POST or PUT /v1/models.

llama.cpp says why it refuses a file only in its log; the log callback installed here keeps
the lines of the thread doing a check and hands every other line to llama-cpp-python's own
callback, so an engine loading on another thread meanwhile logs as before."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

# ggml.h's enum ggml_log_level (llama_cpp/_logger.py still maps the older numbering).
GGML_LOG_LEVEL_ERROR = 4

_captured = threading.local()
_install_lock = threading.Lock()
# The installed callback; referenced here, since ctypes frees a callback nothing holds.
_callback: Any = None


def llama_cpp_refusal(path: Path) -> str | None:
    """None when this build of llama.cpp reads the GGUF's header (its architecture known, its
    hyperparameters and vocabulary readable); else llama.cpp's reason, as it logs it."""
    import llama_cpp

    _install_callback(llama_cpp)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    # An empty device list: no device is enumerated (a GPU build would start its runtime).
    no_devices = (ctypes.c_void_p * 1)()
    params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
    _captured.lines = []
    try:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        errors = _captured.lines
    finally:
        _captured.lines = None
    if model:
        llama_cpp.llama_model_free(model)
        return None
    return _reason(errors)


def _reason(errors: list[str]) -> str:
    """llama.cpp's first error line without the function that logged it ("llama_model_load:
    error loading model: unknown model architecture: 'gpt9'" -> "unknown model architecture:
    'gpt9'")."""
    if not errors:
        return "llama.cpp could not load it and logged no reason"
    line = errors[0].strip()
    _function, colon, rest = line.partition(": ")
    line = rest if colon and " " not in _function else line
    return line.removeprefix("error loading model: ")


def _install_callback(llama_cpp: Any) -> None:
    """Set the log callback for this check. Set again on every check: other code may have set
    its own since (a test capturing llama.cpp's log puts llama-cpp-python's back after it)."""
    global _callback
    with _install_lock:
        if _callback is not None:
            llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
            return
        from llama_cpp import _logger

        forward = _logger.llama_log_callback

        @llama_cpp.llama_log_callback
        def keep_or_forward(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            lines = getattr(_captured, "lines", None)
            if lines is None:
                forward(level, text, user_data)
            elif level == GGML_LOG_LEVEL_ERROR:
                lines.append(text.decode("utf-8", errors="replace"))

        llama_cpp.llama_log_set(keep_or_forward, ctypes.c_void_p(0))
        _callback = keep_or_forward
