"""KV parking (spec §14): a model's conversation state kept in host memory while the model is out
of tier 1, restored when it comes back with the same context layout."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParkedState:
    """One slot's KV state as llama.cpp's per-sequence state API serialises it, and the tokens it
    holds; `layout` must match the context it is restored into."""

    layout: tuple[Any, ...]
    tokens: tuple[int, ...]
    data: bytes
    parked_at: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.data)


class KvParking:
    """Parked states by model, capped at `max_bytes`; the least recently parked go first."""

    def __init__(self, enabled: bool, max_bytes: int):
        self.enabled = enabled
        self.max_bytes = max_bytes
        self._states: OrderedDict[str, ParkedState] = OrderedDict()
        self._lock = threading.Lock()

    def configure(self, enabled: bool | None = None, max_bytes: int | None = None) -> None:
        with self._lock:
            if enabled is not None:
                self.enabled = enabled
            if max_bytes is not None:
                self.max_bytes = max_bytes
            if not self.enabled:
                self._states.clear()
            self._trim()

    def park(self, model: str, state: ParkedState) -> bool:
        """Keep `state` for `model` (replacing an older one); False when it cannot fit at all."""
        with self._lock:
            self._states.pop(model, None)
            if not self.enabled or state.size > self.max_bytes:
                return False
            self._states[model] = state
            self._trim()
            return model in self._states

    def take(self, model: str, layout: tuple[Any, ...]) -> ParkedState | None:
        """The model's parked state if it fits `layout`; a state that does not is dropped."""
        with self._lock:
            state = self._states.pop(model, None)
        return state if state is not None and state.layout == layout else None

    def drop(self, model: str) -> None:
        with self._lock:
            self._states.pop(model, None)

    def _trim(self) -> None:
        while self._states and sum(s.size for s in self._states.values()) > self.max_bytes:
            self._states.popitem(last=False)

    def status(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            return {
                "enabled": self.enabled,
                "max_bytes": self.max_bytes,
                "used_bytes": sum(s.size for s in self._states.values()),
                "models": [
                    {"model": model, "slots": 1, "tokens": len(s.tokens), "bytes": s.size,
                     "parked_secs_ago": round(now - s.parked_at, 1)}
                    for model, s in self._states.items()
                ],
            }
