"""KV parking (spec §14): a model's conversation state kept in host memory while the model is out
of tier 1, restored when it comes back with the same context layout.

A parked state holds every used execution slot of the model (one KV sequence each). With
`server.kv_idle_timeout_secs` a slot whose conversation has been idle that long is dropped, here
as in the loaded engine: its next turn prefills from the start, as it would after a reuse.

A worker that stops (SIGTERM) writes what it has parked to a folder of its own (`save`), one file
per model, and the worker started next takes it back (`load`): a restart or a rolling deploy
keeps the conversations. A file is written whole or not at all (a temporary file renamed), and
one that does not read back (another version, cut short) is dropped with a warning; the layout
check at `take` still decides whether a state fits the model as it is loaded then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
# A parked-state file: MAGIC, the header's length (8 bytes, big-endian), the JSON header, then
# each slot's data in the header's order.
MAGIC = b"HYPNOS-KV-PARK 1\n"
SUFFIX = ".kvpark"


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

    def save(self, folder: Path) -> int:
        """Write every parked state to `folder` (a stopping worker), replacing what was there;
        the number of models written. Ages are kept as the wall clock sees them, so the idle
        timeout counts across the restart."""
        with self._lock:
            self._expire()
            states = list(self._states.items())
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"*{SUFFIX}"):
            old.unlink(missing_ok=True)
        now, wall = self.clock(), time.time()
        for model, state in states:
            header = {
                "model": model,
                "layout": list(state.layout),
                "parked_unix": wall - (now - state.parked_at),
                "slots": [
                    {"seq": s.seq, "tokens": list(s.tokens), "bytes": s.size, "used_unix": wall - (now - s.used_at)}
                    for s in state.slots
                ],
            }
            _write_whole(folder / _file_name(model), _encode(header, state.slots))
        return len(states)

    def load(self, folder: Path) -> int:
        """Take back what `save` wrote to `folder` (a starting worker) and delete the files; the
        number of models taken back. Nothing is taken while parking is off."""
        files = sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []
        taken = 0
        for path in files:
            try:
                if self.enabled:
                    model, state = self._decode(path.read_bytes())
                    taken += self.park(model, state)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping the parked KV state %s: %s", path, exc)
            finally:
                path.unlink(missing_ok=True)
        return taken

    def _decode(self, raw: bytes) -> tuple[str, ParkedState]:
        if not raw.startswith(MAGIC):
            raise ValueError("not a parked-state file of this version")
        at = len(MAGIC)
        (length,) = struct.unpack(">Q", raw[at : at + 8])
        at += 8
        header = json.loads(raw[at : at + length])
        at += length
        now, wall = self.clock(), time.time()
        slots = []
        for slot in header["slots"]:
            size = int(slot["bytes"])
            data = raw[at : at + size]
            if len(data) != size:
                raise ValueError("the file is cut short")
            at += size
            used_at = now - max(0.0, wall - float(slot["used_unix"]))
            slots.append(ParkedSlot(int(slot["seq"]), tuple(int(t) for t in slot["tokens"]), data, used_at))
        if at != len(raw):
            raise ValueError("the file has bytes past its last slot")
        parked_at = now - max(0.0, wall - float(header["parked_unix"]))
        return str(header["model"]), ParkedState(tuple(header["layout"]), tuple(slots), parked_at)

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


def _file_name(model: str) -> str:
    """A file name for any model id (ids may hold '/' or ':'); the id itself is in the header."""
    return hashlib.sha256(model.encode()).hexdigest()[:24] + SUFFIX


def _encode(header: dict[str, Any], slots: tuple[ParkedSlot, ...]) -> list[bytes]:
    encoded = json.dumps(header).encode()
    return [MAGIC, struct.pack(">Q", len(encoded)), encoded, *(s.data for s in slots)]


def _write_whole(path: Path, parts: list[bytes]) -> None:
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".kvpark-")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                out.write(part)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
