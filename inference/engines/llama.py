"""llama.cpp through llama-cpp-python: GGUF chat models with the template the GGUF carries."""

from __future__ import annotations

import codecs
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp._internals as internals
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from hypnos_site.config import ModelConfig
from inference.engines.base import ChatResult, ChatWork, Engine, LoadPhases, WarmCopy, drop_page_cache
from inference.engines.text import StopMatcher
from inference.errors import ContextLengthExceeded, DeviceOutOfMemory, InvalidRequest, ModelNotAvailable
from memory.planner import Footprint, footprint_from_gguf

# Sampling defaults when the request leaves a value out (llama.cpp's own defaults).
DEFAULT_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}


class _TimedContext(internals.LlamaContext):
    """llama-cpp-python builds the model and then the context inside one constructor; this
    subclass (installed below) times the context part, so loads report both phases."""

    timing = threading.local()

    def __init__(self, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        super().__init__(*args, **kwargs)
        _TimedContext.timing.ms = (time.perf_counter() - started) * 1000


internals.LlamaContext = _TimedContext  # type: ignore[misc]


class LlamaEngine(Engine):
    """One `llama_cpp.Llama` per model, mapped from the worker's warm copy of the GGUF; chat
    prompts are rendered with the GGUF's own template."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None):
        super().__init__(model, weights, n_threads)
        self._llm: llama_cpp.Llama | None = None
        self._formatter: Jinja2ChatFormatter | None = None
        self._warm: WarmCopy | None = None
        self._footprint: Footprint | None = None

    @property
    def loaded(self) -> bool:
        return self._llm is not None

    @property
    def context_len(self) -> int:
        return self._llm.n_ctx() if self._llm else 0

    @property
    def trained_context_len(self) -> int:
        return self.footprint().trained_context_len

    def footprint(self) -> Footprint:
        if self._footprint is None:
            try:
                self._footprint = footprint_from_gguf(self.weights)
            except (OSError, ValueError, KeyError) as exc:
                raise ModelNotAvailable(f"model {self.model.id!r}: {self.weights} is not a readable GGUF: {exc}") from exc
        return self._footprint

    @property
    def warm_bytes(self) -> int:
        return self._warm.size if self._warm else 0

    def warm(self) -> float:
        if self._warm is not None:
            return 0.0
        started = time.perf_counter()
        self._warm = WarmCopy(self.weights)
        return (time.perf_counter() - started) * 1000

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        self.warm()
        assert self._warm is not None
        try:
            llm = llama_cpp.Llama(
                model_path=self._warm.path,
                n_ctx=context_len,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                n_gpu_layers=gpu_layers,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelNotAvailable(f"model {self.model.id!r} could not be loaded from {self.weights}: {exc}") from exc
        context_ms = getattr(_TimedContext.timing, "ms", 0.0)
        self._llm = llm
        self._formatter = self._chat_formatter(llm)
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=total_ms - context_ms, context_ms=context_ms, total_ms=total_ms)

    def unload(self) -> None:
        if self._llm is not None:
            self._llm.close()
        self._llm = None
        self._formatter = None

    def cool(self) -> None:
        self.unload()
        if self._warm is not None:
            self._warm.close()
            self._warm = None
        drop_page_cache(self.weights)

    def chat(self, work: ChatWork, cancel: threading.Event, on_delta: Callable[[str], None]) -> ChatResult:
        llm, formatter = self._llm, self._formatter
        assert llm is not None and formatter is not None, "chat on an unloaded engine"
        try:
            prompt = formatter(messages=work.messages).prompt
        except Exception as exc:  # jinja2 raises whatever the template's raise_exception says
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        n_ctx = llm.n_ctx()
        if len(tokens) >= n_ctx:
            raise ContextLengthExceeded(
                f"The prompt is {len(tokens)} tokens but the model's context is {n_ctx} tokens; "
                "send fewer messages or ask for a larger num_ctx.",
                param="messages",
            )
        if work.seed is not None:
            # A reused prefix re-evaluates only the tail, whose logits differ in the last bits
            # from a whole-prompt evaluation; a seeded run must not depend on the previous one.
            llm.reset()
        cached = self._cached_prefix(tokens)
        llm.set_seed(work.seed if work.seed is not None else random.randrange(2**31))
        return self._generate(llm, tokens, cached, work, min(work.max_tokens, n_ctx - len(tokens)), cancel, on_delta)

    def _generate(
        self,
        llm: llama_cpp.Llama,
        tokens: list[int],
        cached: int,
        work: ChatWork,
        max_tokens: int,
        cancel: threading.Event,
        on_delta: Callable[[str], None],
    ) -> ChatResult:
        stops = StopMatcher(work.stop)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        vocab = llm._model.vocab
        finish, produced, first_at = "length", 0, None
        started = time.perf_counter()
        generator = llm.generate(
            tokens,
            temp=_pick(work.temperature, "temperature"),
            top_p=_pick(work.top_p, "top_p"),
            top_k=_pick(work.top_k, "top_k"),
            repeat_penalty=1.0,
        )
        try:
            for token in _oom_as_typed(generator):
                first_at = first_at or time.perf_counter()
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    finish = "stop"
                    break
                produced += 1
                text, stopped = stops.feed(decoder.decode(llm.detokenize([token], special=False)))
                if text:
                    on_delta(text)
                if stopped:
                    finish = "stop"
                    break
                if cancel.is_set():
                    finish = "cancelled"
                    break
                if produced >= max_tokens:
                    break
        finally:
            generator.close()
        # After a stop string the matcher holds nothing; otherwise release what it held back.
        tail = stops.flush() + decoder.decode(b"", final=True)
        if tail:
            on_delta(tail)
        ended = time.perf_counter()
        first_at = first_at or ended
        return ChatResult(
            finish_reason=finish,
            prompt_tokens=len(tokens),
            completion_tokens=produced,
            cached_tokens=cached,
            prefill_ms=(first_at - started) * 1000,
            decode_ms=(ended - first_at) * 1000,
            ttft_ms=(first_at - started) * 1000,
        )

    def _cached_prefix(self, tokens: list[int]) -> int:
        """Prompt tokens whose KV the context still holds from the previous request."""
        llm = self._llm
        assert llm is not None
        same = 0
        for a, b in zip(llm._input_ids[: llm.n_tokens], tokens):
            if a != b:
                break
            same += 1
        # llama-cpp-python re-evaluates the last prompt token to refresh the logits.
        return min(same, len(tokens) - 1)

    def _chat_formatter(self, llm: llama_cpp.Llama) -> Jinja2ChatFormatter:
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ModelNotAvailable(f"model {self.model.id!r} has no chat template in its GGUF")
        model = llm._model
        eos, bos = llm.token_eos(), llm.token_bos()
        return Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos],
        )


def _oom_as_typed(tokens: Iterator[int]) -> Iterator[int]:
    """llama_decode returns -2/-3 when it cannot allocate its buffers: a device out of memory."""
    try:
        yield from tokens
    except RuntimeError as exc:
        if "llama_decode returned -2" in str(exc) or "llama_decode returned -3" in str(exc):
            raise DeviceOutOfMemory(f"the engine ran out of memory: {exc}") from exc
        raise


def _pick(value: Any, name: str) -> Any:
    return DEFAULT_SAMPLING[name] if value is None else value
