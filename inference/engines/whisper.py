"""Speech-to-text with Whisper through faster-whisper (CTranslate2).

The model is a CTranslate2 folder (`model.bin`, `config.json`, `tokenizer.json`, vocabulary).
Tier 2 holds `model.bin` in a memfd and the small files in memory; a load hands CTranslate2 the
files from there (its `files=` argument), so a promotion reads nothing from the disk."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import ctranslate2
import numpy as np
from faster_whisper import WhisperModel

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, InvalidRequest, ModelNotAvailable
from inference.engines.base import Engine, LoadPhases, TranscribeOptions
from inference.transport.transcripts import Segment, Transcript, Word
from memory.planner import Footprint, footprint_from_files

# Measured on Whisper tiny.en int8 (2-core CPU): the process grows ~80 MB beyond the weights
# while transcribing 20 s of audio (encoder activations, beam and decoder caches).
WORKSPACE_BYTES = 96 << 20
WEIGHTS_FILE = "model.bin"
# OpenAI's temperature 0: start greedy and raise the temperature when a segment fails the
# compression-ratio or log-probability checks.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


class WhisperEngine(Engine):
    """One `faster_whisper.WhisperModel`, on CUDA when CTranslate2 sees a GPU, else int8 on CPU."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None):
        super().__init__(model, weights, n_threads)
        self._model: WhisperModel | None = None
        self._small_files: dict[str, bytes] = {}
        self._context_len = 0

    @property
    def files(self) -> list[Path]:
        if not (self.weights / WEIGHTS_FILE).is_file():
            raise ModelNotAvailable(f"model {self.model.id!r}: {self.weights} is not a CTranslate2 Whisper folder")
        return sorted(p for p in self.weights.iterdir() if p.is_file())

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def context_len(self) -> int:
        return self._context_len

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    @property
    def warm_bytes(self) -> int:
        return (self._warm.size if self._warm else 0) + sum(len(b) for b in self._small_files.values())

    def warm(self) -> float:
        if self._warm is None:
            # The small files (config, vocabulary) are kept as bytes beside the memfd weights.
            self._small_files = {p.name: p.read_bytes() for p in self.files if p.name != WEIGHTS_FILE}
        return self._hold(self.weights / WEIGHTS_FILE)

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        weights_ms = self.warm()
        assert self._warm is not None
        cuda = ctranslate2.get_cuda_device_count() > 0
        try:
            with open(self._warm.path, "rb") as weights:
                self._model = WhisperModel(
                    str(self.weights),
                    device="cuda" if cuda else "cpu",
                    compute_type="float16" if cuda else "int8",
                    cpu_threads=self.n_threads or 0,
                    files={**self._small_files, WEIGHTS_FILE: weights},
                )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelNotAvailable(f"model {self.model.id!r} could not be loaded from {self.weights}: {exc}") from exc
        self._context_len = context_len
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms or total_ms, context_ms=0.0, total_ms=total_ms)

    def unload(self) -> None:
        self._model = None
        self._context_len = 0

    def cool(self) -> None:
        self.unload()
        self._small_files = {}
        self._release(self.files)

    def transcribe(self, samples: np.ndarray, options: TranscribeOptions, cancel: threading.Event) -> Transcript:
        from inference.engines.audio import TRANSCRIBE_RATE

        model = self._model
        assert model is not None, "transcribe on an unloaded engine"
        language = options.language
        if language and not model.model.is_multilingual and language != "en":
            raise InvalidRequest(
                f"The model {self.model.id!r} transcribes English only (language 'en').", param="language"
            )
        temperature = options.temperature or 0.0
        word_timestamps = options.word_timestamps
        segments, info = model.transcribe(
            samples,
            language=language if model.model.is_multilingual else "en",
            initial_prompt=options.prompt or None,
            temperature=FALLBACK_TEMPERATURES if temperature == 0 else temperature,
            beam_size=5,
            word_timestamps=word_timestamps,
            condition_on_previous_text=False,
        )
        found: list[Segment] = []
        for segment in segments:  # decoding happens while iterating
            if cancel.is_set():
                raise Cancelled("the request was cancelled")
            found.append(_segment(segment, len(found), word_timestamps))
        return Transcript(
            text=" ".join(s.text.strip() for s in found).strip(),
            language=info.language,
            segments=found,
            duration_secs=round(len(samples) / TRANSCRIBE_RATE, 3),
        )


def _segment(segment: Any, index: int, with_words: bool) -> Segment:
    words = None
    if with_words:
        words = [Word(word=w.word, start=round(w.start, 2), end=round(w.end, 2)) for w in segment.words or []]
    return Segment(
        id=index,
        seek=segment.seek,
        start=round(segment.start, 2),
        end=round(segment.end, 2),
        text=segment.text,
        tokens=list(segment.tokens),
        temperature=segment.temperature,
        avg_logprob=segment.avg_logprob,
        compression_ratio=segment.compression_ratio,
        no_speech_prob=segment.no_speech_prob,
        words=words,
    )
