"""Text-to-speech voices in ONNX, through onnxruntime: Piper voices (`*.onnx` + `*.onnx.json`)
and Kokoro (`kokoro*.onnx` + `voices*.bin`, through the `kokoro-onnx` package on a GPU box).

The model's folder holds the voice; tier 2 holds its ONNX graph in a memfd the session is built
from, so a promotion reads no disk. Phrase chunking, the 180 ms pauses, resampling to 24 kHz and
the output formats are the worker's (inference/worker/media.py, inference/engines/audio.py), the
same for every voice family."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from hypnos_site.config import ModelConfig
from hypnos_site.errors import InvalidRequest, ModelNotAvailable
from inference.engines.base import Engine, LoadPhases
from inference.engines.onnx_session import providers
from memory.planner import Footprint, footprint_from_files

# Measured with Piper en_US-joe-medium (2-core CPU): ~145 MB beyond the graph while synthesizing
# a long sentence (the VITS decoder's activations grow with the phrase).
WORKSPACE_BYTES = 160 << 20

# OpenAI voice names -> Kokoro voices (spec §10); any other name falls back to af_heart.
KOKORO_VOICES = {
    "alloy": "af_alloy",
    "echo": "am_echo",
    "fable": "bm_fable",
    "onyx": "am_onyx",
    "nova": "af_nova",
    "shimmer": "af_bella",
    "coral": "af_bella",
    "ash": "am_adam",
    "sage": "af_sarah",
    "ballad": "bm_george",
    "verse": "am_michael",
}
KOKORO_DEFAULT_VOICE = "af_heart"
# Kokoro's phonemizer languages by ISO 639-1 code, and each voice's own by its id's first letter
# (af_heart: American English, bf_emma: British English, jf_alpha: Japanese, ...).
KOKORO_LANGUAGES = {
    "en": "en-us",
    "es": "es",
    "fr": "fr-fr",
    "hi": "hi",
    "it": "it",
    "ja": "ja",
    "pt": "pt-br",
    "zh": "cmn",
}
KOKORO_VOICE_LANGUAGES = {
    "a": "en-us",
    "b": "en-gb",
    "e": "es",
    "f": "fr-fr",
    "h": "hi",
    "i": "it",
    "j": "ja",
    "p": "pt-br",
    "z": "cmn",
}


def primary_subtag(language: str) -> str:
    """en-GB, en_US, EN -> en."""
    return language.replace("_", "-").split("-")[0].lower()


class Voice(ABC):
    """One loaded voice family."""

    @abstractmethod
    def language(self, voice: str, requested: str | None) -> str:
        """What Engine.speech_language answers for this family."""

    @abstractmethod
    def synthesize(self, text: str, voice: str, speed: float, language: str) -> tuple[np.ndarray, int]: ...


class PiperFamily(Voice):
    def __init__(self, graph: str, config: dict[str, Any]):
        from piper import PiperVoice
        from piper.config import PiperConfig

        session = onnxruntime.InferenceSession(graph, sess_options=onnxruntime.SessionOptions(), providers=providers())
        self.voice = PiperVoice(config=PiperConfig.from_dict(config), session=session)
        self.speakers: dict[str, int] = config.get("speaker_id_map") or {}
        # A Piper voice speaks one language, named in its config (en_US); older configs name
        # only their espeak voice (en-us).
        declared = config.get("language", {}).get("code") or config.get("espeak", {}).get("voice") or "en"
        self.own_language: str = declared

    def language(self, voice: str, requested: str | None) -> str:
        if requested is not None and primary_subtag(requested) != primary_subtag(self.own_language):
            raise InvalidRequest(
                f"This Piper voice speaks {self.own_language} only, not {requested!r}; "
                "leave language out or use a voice of that language.",
                param="language",
            )
        return self.own_language

    def synthesize(self, text: str, voice: str, speed: float, language: str) -> tuple[np.ndarray, int]:
        from piper.config import SynthesisConfig

        config = self.voice.config
        # A multi-speaker voice takes its speakers' names; OpenAI names get its first speaker.
        speaker = self.speakers.get(voice, 0) if self.speakers else None
        syn = SynthesisConfig(speaker_id=speaker, length_scale=config.length_scale / speed)
        chunks = [c.audio_float_array for c in self.voice.synthesize(text, syn)]
        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return samples, config.sample_rate


class KokoroFamily(Voice):
    """Kokoro-82M through `kokoro-onnx` (24 kHz). Needs its weights, which no registry carries,
    so it runs on a box that has them (see docs/engines.md)."""

    def __init__(self, graph: str, voices: Path):
        try:
            from kokoro_onnx import Kokoro
        except ImportError as exc:
            raise ModelNotAvailable("Kokoro voices need the kokoro-onnx package (pip install kokoro-onnx)") from exc
        session = onnxruntime.InferenceSession(graph, providers=providers())
        self.kokoro = Kokoro.from_session(session, str(voices))

    def _voice_name(self, voice: str) -> str:
        return voice if voice in set(self.kokoro.get_voices()) else KOKORO_VOICES.get(voice, KOKORO_DEFAULT_VOICE)

    def language(self, voice: str, requested: str | None) -> str:
        own = KOKORO_VOICE_LANGUAGES.get(self._voice_name(voice)[:1], "en-us")
        if requested is None:
            return own
        code = primary_subtag(requested)
        if code not in KOKORO_LANGUAGES:
            raise InvalidRequest(
                f"Kokoro speaks {', '.join(sorted(KOKORO_LANGUAGES))}; not {requested!r}.", param="language"
            )
        # English keeps the voice's accent (a British voice stays en-gb).
        return own if primary_subtag(own) == code else KOKORO_LANGUAGES[code]

    def synthesize(self, text: str, voice: str, speed: float, language: str) -> tuple[np.ndarray, int]:
        samples, rate = self.kokoro.create(text, voice=self._voice_name(voice), speed=speed, lang=language)
        return np.asarray(samples, dtype=np.float32), rate


class OnnxSpeechEngine(Engine):
    """A speech voice whose family is told by the files in its folder."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None):
        super().__init__(model, weights, n_threads)
        self._voice: Voice | None = None
        self._context_len = 0
        self.graph, self.family = self._find_graph()

    def _find_graph(self) -> tuple[Path, str]:
        folder = self.weights if self.weights.is_dir() else self.weights.parent
        graphs = sorted(folder.glob("*.onnx"))
        if len(graphs) != 1:
            raise ModelNotAvailable(f"model {self.model.id!r}: {folder} must hold one .onnx voice, not {len(graphs)}")
        graph = graphs[0]
        if graph.with_name(graph.name + ".json").is_file():
            return graph, "piper"
        if graph.name.startswith("kokoro") and self._kokoro_voices(folder):
            return graph, "kokoro"
        raise ModelNotAvailable(
            f"model {self.model.id!r}: {graph.name} is neither a Piper voice (no .onnx.json) "
            "nor Kokoro (no voices*.bin)"
        )

    @staticmethod
    def _kokoro_voices(folder: Path) -> Path | None:
        found = sorted(folder.glob("voices*.bin"))
        return found[0] if found else None

    @property
    def files(self) -> list[Path]:
        return sorted(p for p in self.graph.parent.iterdir() if p.is_file())

    @property
    def loaded(self) -> bool:
        return self._voice is not None

    @property
    def context_len(self) -> int:
        return self._context_len

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    def warm(self) -> float:
        return self._hold(self.graph)

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        weights_ms = self.warm()
        assert self._warm is not None
        try:
            if self.family == "piper":
                config = json.loads(self.graph.with_name(self.graph.name + ".json").read_text())
                self._voice = PiperFamily(self._warm.path, config)
            else:
                voices = self._kokoro_voices(self.graph.parent)
                assert voices is not None
                self._voice = KokoroFamily(self._warm.path, voices)
        except (ValueError, RuntimeError, OSError, onnxruntime.capi.onnxruntime_pybind11_state.Fail) as exc:
            raise ModelNotAvailable(f"model {self.model.id!r} could not be loaded from {self.graph}: {exc}") from exc
        self._context_len = context_len
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms or total_ms, context_ms=0.0, total_ms=total_ms)

    def unload(self) -> None:
        self._voice = None
        self._context_len = 0

    def cool(self) -> None:
        self.unload()
        self._release(self.files)

    def speech_language(self, voice: str, language: str | None) -> str:
        assert self._voice is not None, "speech_language on an unloaded engine"
        return self._voice.language(voice, language)

    def synthesize(self, text: str, voice: str, speed: float, language: str) -> tuple[np.ndarray, int]:
        assert self._voice is not None, "synthesize on an unloaded engine"
        return self._voice.synthesize(text, voice, speed, language)
