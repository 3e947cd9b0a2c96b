"""KV parking (spec §14): a model's conversation state kept in host memory while the model is out
of tier 1, restored when it comes back with the same context layout.

A parked state holds every used execution slot of the model (one KV sequence each). With
`server.kv_idle_timeout_secs` a slot whose conversation has been idle that long is dropped, here
as in the loaded engine: its next turn prefills from the start, as it would after a reuse.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ParkedSlot:
    """One slot's KV sequence as llama.cpp's per-sequence state API serialises it, the tokens it
    holds, and when its conversation was last served (`time.monotonic()`)."""

    seq: int
    tokens: tuple[int, ...]
    data: bytes
    used_at: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class ParkedState:
    """A model's used slots; `layout` must match the context they are restored into."""

    layout: tuple[Any, ...]
    slots: tuple[ParkedSlot, ...]
    parked_at: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.slots)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots)

    def used_since(self, since: float) -> ParkedState:
        """The slots whose conversation was served at or after `since`."""
        return replace(self, slots=tuple(s for s in self.slots if s.used_at >= since))


class KvParking:
    """Parked states by model, capped at `max_bytes`; the least recently parked go first. Slots
    idle for longer than `idle_timeout_secs` (when set) are dropped."""

    def __init__(
        self, enabled: bool, max_bytes: int, idle_timeout_secs: float | None = None, clock: Any = time.monotonic
    ):
        self.enabled = enabled
        self.max_bytes = max_bytes
        self.idle_timeout_secs = idle_timeout_secs
        self.clock = clock
        self._states: OrderedDict[str, ParkedState] = OrderedDict()
        self._lock = threading.Lock()

    def configure(self, enabled: bool | None = None, max_bytes: int | None = None) -> None:
        """POST /v1/memory/kv-park: turning parking off drops every state, a lower cap the oldest."""
        with self._lock:
            if enabled is not None:
                self.enabled = enabled
            if max_bytes is not None:
                self.max_bytes = max_bytes
            if not self.enabled:
                self._states.clear()
            self._trim()

    def park(self, model: str, state: ParkedState) -> bool:
        """Keep `state` for `model` (replacing an older one); False when nothing of it is kept
        (parking off, every slot idle too long, or larger than the cap)."""
        with self._lock:
            self._states.pop(model, None)
            state = self._fresh(state)
            if not self.enabled or not state.slots or state.size > self.max_bytes:
                return False
            self._states[model] = state
            self._trim()
            return model in self._states

    def take(self, model: str, layout: tuple[Any, ...]) -> ParkedState | None:
        """The model's parked state if it fits `layout`; a state that does not is dropped."""
        with self._lock:
            state = self._states.pop(model, None)
        if state is None or state.layout != layout:
            return None
        state = self._fresh(state)
        return state if state.slots else None

    def drop(self, model: str) -> None:
        with self._lock:
            self._states.pop(model, None)

    def _fresh(self, state: ParkedState) -> ParkedState:
        if self.idle_timeout_secs is None:
            return state
        return state.used_since(self.clock() - self.idle_timeout_secs)

    def _expire(self) -> None:
        """Drop the slots (and the states left with none) idle past the timeout."""
        for model, state in list(self._states.items()):
            fresh = self._fresh(state)
            if not fresh.slots:
                del self._states[model]
            elif len(fresh.slots) < len(state.slots):
                self._states[model] = fresh

    def _trim(self) -> None:
        while self._states and sum(s.size for s in self._states.values()) > self.max_bytes:
            self._states.popitem(last=False)

    def status(self) -> dict[str, Any]:
        """The `kv_park` object of /v1/memory/status and /v1/memory/kv-park."""
        with self._lock:
            self._expire()
            now = self.clock()
            return {
                "enabled": self.enabled,
                "max_bytes": self.max_bytes,
                "used_bytes": sum(s.size for s in self._states.values()),
                "models": [
                    {
                        "model": model,
                        "slots": len(s.slots),
                        "tokens": s.tokens,
                        "bytes": s.size,
                        "parked_secs_ago": round(now - s.parked_at, 1),
                    }
                    for model, s in self._states.items()
                ],
            }
