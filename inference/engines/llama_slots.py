"""Execution slots that share decode steps: the requests running on one llama.cpp model are
evaluated together, one llama_decode per step, each in its own KV sequence with its own
sampler, grammar and stop strings (spec §7.3).

One scheduler thread owns the llama context. Requests hand it a `SlotJob` and wait; it admits
jobs into free slots (the slot whose cached tokens share the longest prefix with the prompt, so
a conversation's next turn re-evaluates only its new tokens), builds each step's batch from the
pending prompt chunks and the last sampled tokens, decodes, samples and streams.

KV parking (spec §14) saves every used slot's sequence when the model leaves tier 1 and puts
each back into the same sequence when it returns, so a conversation's next turn finds its prefix
in the slot it left; `server.kv_idle_timeout_secs` empties the slots idle that long.

Compaction. The slots share one unified KV, and llama.cpp attends over every cell up to the last
one in use, of all sequences (masked): after a round of concurrent streams, whose tokens were
laid down interleaved, a single stream attended over all of them and decoded at ~0.75 of its
speed until the server restarted (bench/server_cost.py's (e)). So a job that starts on an idle
scheduler while other slots hold cells stashes those slots' sequences in host memory (each slot
keeps its token list, so its prefix still counts when the next job is placed), clears the KV
and puts its own prefix back at the start of it; a stashed slot's sequence goes back into the KV
when a job is placed on it. Done only while the copies stay under COMPACT_MAX_BYTES, so it costs
a few milliseconds at most (llama-server keeps idle slots' prompts in host memory the same way).
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import llama_cpp._internals as internals

from hypnos_site.errors import DeviceOutOfMemory, ServerError
from inference.engines.base import ChatResult
from inference.engines.llama_sampling import GrammarSampler
from inference.engines.text import StopMatcher
from memory.kv_park import ParkedSlot

log = logging.getLogger(__name__)
BATCH_TOKENS = 512
# The most bytes of sequence state a compaction copies, and the most the stashes hold together.
COMPACT_MAX_BYTES = 64 << 20


@dataclass
class SlotJob:
    """One generation: prompt tokens in, tokens out through `emit`, a ChatResult at the end."""

    tokens: list[int]
    sampler: internals.LlamaSampler | GrammarSampler
    stops: StopMatcher
    max_tokens: int
    cancel: threading.Event
    # (text, token, batch index): called on the scheduler thread for every sampled token.
    emit: Callable[[str, int, int], None]
    # A seeded run re-evaluates its whole prompt: a reused prefix's tail rounds differently.
    reuse_prefix: bool = True
    # A batch's line (x-hypnos-priority: background): it sits out the steps in which an
    # interactive job has yet to give its first token (bench/batches.py).
    background: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: ChatResult | None = None
    error: BaseException | None = None
    # Scheduler state.
    pending: list[int] = field(default_factory=list)
    produced: int = 0
    cached: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    concurrency: int = 1
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))


@dataclass
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)
    job: SlotJob | None = None
    # When the slot's conversation was last served (time.monotonic()).
    used_at: float = field(default_factory=time.monotonic)
    # The sequence of `tokens`, in host memory while its cells are out of the KV (compaction).
    stash: bytes | None = None


def seq_state(ctx: llama_cpp.llama_context_p, seq: int) -> bytes | None:
    """Sequence `seq`'s KV cells, serialised by llama.cpp (None when it has none)."""
    size = llama_cpp.llama_state_seq_get_size(ctx, seq)
    if size == 0:
        return None
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq)
    return bytes(buffer[:written]) if written else None


def set_seq_state(ctx: llama_cpp.llama_context_p, seq: int, data: bytes) -> bool:
    """Load a serialised sequence into `seq`; False when llama.cpp refuses it (no room, another
    layout), in which case the sequence is left empty."""
    buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return llama_cpp.llama_state_seq_set_data(ctx, buffer, len(data), seq) != 0


class SlotScheduler:
    def __init__(self, llm: llama_cpp.Llama, n_slots: int):
        self.llm = llm
        self.slots = [_Slot(seq) for seq in range(n_slots)]
        self.batch = internals.LlamaBatch(n_tokens=BATCH_TOKENS, embd=0, n_seq_max=1, verbose=False)
        self.queue: deque[SlotJob] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="hypnos-slots", daemon=True)
        self.thread.start()

    def run(self, job: SlotJob) -> ChatResult:
        """Queue the job and wait for it (the caller's cancel flag ends it at the next step)."""
        with self.cond:
            self.queue.append(job)
            self.cond.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def park(self) -> tuple[ParkedSlot, ...]:
        """Every used slot's sequence, for KV parking. Called while the model is idle (no lease),
        so no decode runs on the context meanwhile."""
        with self.cond:
            parked = []
            for slot in self.slots:
                data = None
                if slot.tokens and slot.job is None:
                    data = slot.stash if slot.stash is not None else seq_state(self.llm.ctx, slot.seq)
                if data is not None:
                    parked.append(ParkedSlot(slot.seq, tuple(slot.tokens), data, slot.used_at))
            return tuple(parked)

    def restore(self, parked: tuple[ParkedSlot, ...]) -> int:
        """Put parked sequences back into the same slots of a freshly loaded context (before it
        takes requests); the tokens restored."""
        restored = 0
        with self.cond:
            for state in parked:
                slot = self.slots[state.seq]
                if set_seq_state(self.llm.ctx, state.seq, state.data):
                    slot.tokens, slot.used_at = list(state.tokens), state.used_at
                    restored += len(state.tokens)
        return restored

    def empty_idle(self, idle_secs: float) -> int:
        """Empty the KV of the slots idle for `idle_secs` or more; the tokens dropped. Does
        nothing while a job runs (the decode owns the context)."""
        with self.cond:
            if self._active() or self.queue:
                return 0
            dropped = 0
            for slot in self.slots:
                if slot.tokens and time.monotonic() - slot.used_at >= idle_secs:
                    llama_cpp.llama_memory_seq_rm(self.llm._ctx.memory, slot.seq, 0, -1)
                    dropped += len(slot.tokens)
                    slot.tokens, slot.stash = [], None
            return dropped

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()
        self.batch.close()

    # -- the scheduler thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.stopping and not self.queue and not self._active():
                    self.cond.wait()
                if self.stopping:
                    self._fail_all(ServerError("the model was unloaded while the request ran"))
                    return
                self._admit()
            try:
                self._step()
            except BaseException as exc:  # a decode failure ends every job in the step
                log.exception("batched decode failed")
                self._fail_all(exc)

    def _active(self) -> list[_Slot]:
        return [s for s in self.slots if s.job is not None]

    def _admit(self) -> None:
        free = [s for s in self.slots if s.job is None]
        while self.queue and free:
            job = self.queue.popleft()
            if job.cancel.is_set():
                self._finish(None, job, "cancelled")
                continue
            idle = len(free) == len(self.slots)
            slot = max(free, key=lambda s: _common_prefix(s.tokens, job.tokens))
            free.remove(slot)
            # Keep the shared prefix; the last prompt token is always evaluated for its logits.
            reuse = min(_common_prefix(slot.tokens, job.tokens), len(job.tokens) - 1) if job.reuse_prefix else 0
            compacted = self._compact(slot, reuse) if idle else None
            reuse = self._unstash(slot, reuse) if compacted is None else compacted
            llama_cpp.llama_memory_seq_rm(self.llm._ctx.memory, slot.seq, reuse, -1)
            slot.tokens = slot.tokens[:reuse]
            job.cached = reuse
            job.pending = job.tokens[reuse:]
            slot.job = job

    def _compact(self, keep: _Slot, reuse: int) -> int | None:
        """Stash the other slots' sequences, clear the KV and put `keep`'s first `reuse` tokens
        back at its start (see the module's docstring); the tokens the job may reuse. None, with
        nothing changed, when no other slot holds cells or the copies would pass
        COMPACT_MAX_BYTES."""
        ctx, memory = self.llm.ctx, self.llm._ctx.memory
        others = [s for s in self.slots if s is not keep and s.tokens and s.stash is None]
        if not others:
            return None
        sizes = [llama_cpp.llama_state_seq_get_size(ctx, s.seq) for s in others]
        stashed = sum(len(s.stash) for s in self.slots if s.stash is not None)
        if stashed + sum(sizes) + (len(keep.stash) if keep.stash else 0) > COMPACT_MAX_BYTES:
            return None
        if keep.stash is None:
            llama_cpp.llama_memory_seq_rm(memory, keep.seq, reuse, -1)
            kept = seq_state(ctx, keep.seq) if reuse else None
        else:
            kept, keep.stash = (keep.stash if reuse else None), None
        for slot in others:
            slot.stash = seq_state(ctx, slot.seq)
            if slot.stash is None:
                slot.tokens = []
        llama_cpp.llama_memory_clear(memory, True)
        # A stash holds the slot's whole sequence: cut it back to the prefix the job shares.
        if kept is None or not set_seq_state(ctx, keep.seq, kept):
            keep.tokens = []
            return 0
        return reuse

    def _unstash(self, slot: _Slot, reuse: int) -> int:
        """Put a stashed slot's sequence back into the KV; the tokens of it the job may reuse
        (0 when llama.cpp finds no room for it, and the slot starts empty)."""
        if slot.stash is None:
            return reuse
        data, slot.stash = slot.stash, None
        if reuse and set_seq_state(self.llm.ctx, slot.seq, data):
            return reuse
        llama_cpp.llama_memory_seq_rm(self.llm._ctx.memory, slot.seq, 0, -1)
        slot.tokens = []
        return 0

    def _step(self) -> None:
        """One llama_decode: one token of every generating slot plus prompt chunks in the room
        that is left. (llama.cpp's kernels are not batch-invariant: what shares a step changes
        the last bits of the logits, so an answer under load can differ from the same request
        run alone, as on every batching server.)"""
        batch, room = self.batch.batch, BATCH_TOKENS
        batch.n_tokens = 0
        sampling: list[tuple[_Slot, int]] = []
        active = self._active()
        # Background jobs wait while an interactive one has yet to give its first token.
        yielding = any(s.job is not None and not s.job.background and s.job.first_at is None for s in active)
        # Generating slots first (one token each), then prompt chunks.
        for slot in sorted(active, key=lambda s: len(s.job.pending) > 1):  # type: ignore[union-attr]
            job = slot.job
            assert job is not None
            if job.cancel.is_set():
                self._finish(slot, job, "cancelled")
                continue
            if yielding and job.background:
                continue
            take = job.pending[:room]
            if not take:
                continue
            for token in take:
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, len(slot.tokens), 1
                batch.seq_id[i][0] = slot.seq
                batch.logits[i] = False
                slot.tokens.append(token)
                batch.n_tokens += 1
            room -= len(take)
            job.pending = job.pending[len(take) :]
            if not job.pending:
                batch.logits[batch.n_tokens - 1] = True
                sampling.append((slot, batch.n_tokens - 1))
        if batch.n_tokens == 0:
            return
        code = llama_cpp.llama_decode(self.llm._ctx.ctx, batch)
        if code != 0:
            raise (DeviceOutOfMemory if code in (-2, -3) else ServerError)(f"llama_decode returned {code}")
        for slot, index in sampling:
            job = slot.job
            assert job is not None
            job.concurrency = max(job.concurrency, len(sampling))
            self._sampled(slot, job, job.sampler.sample(self.llm._ctx, index), index)

    def _sampled(self, slot: _Slot, job: SlotJob, token: int, index: int) -> None:
        job.first_at = job.first_at or time.perf_counter()
        if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token):
            self._finish(slot, job, "stop")
            return
        job.produced += 1
        text, stopped = job.stops.feed(job.decoder.decode(self.llm.detokenize([token], special=False)))
        job.emit(text, token, index)
        if stopped:
            self._finish(slot, job, "stop")
        elif job.cancel.is_set():
            self._finish(slot, job, "cancelled")
        elif job.produced >= job.max_tokens:
            self._finish(slot, job, "length")
        else:
            job.pending = [token]

    def _finish(self, slot: _Slot | None, job: SlotJob, reason: str) -> None:
        tail = job.stops.flush() + job.decoder.decode(b"", final=True)
        if tail:
            job.emit(tail, -1, -1)
        ended = time.perf_counter()
        first = job.first_at or ended
        job.result = ChatResult(
            finish_reason=reason,
            prompt_tokens=len(job.tokens),
            completion_tokens=job.produced,
            cached_tokens=job.cached,
            prefill_ms=(first - job.started) * 1000,
            decode_ms=(ended - first) * 1000,
            ttft_ms=(first - job.started) * 1000,
            concurrent_slots=job.concurrency,
            stop_sequence=job.stops.matched,
        )
        if slot is not None:
            slot.job = None
            slot.used_at = time.monotonic()
        job.sampler.close()
        job.done.set()

    def _fail_all(self, error: BaseException) -> None:
        for slot in self._active():
            job = slot.job
            assert job is not None
            slot.job = None
            slot.tokens, slot.stash = [], None
            llama_cpp.llama_memory_seq_rm(self.llm._ctx.memory, slot.seq, 0, -1)
            job.error = error
            job.done.set()
        while self.queue:
            job = self.queue.popleft()
            job.error = error
            job.done.set()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
