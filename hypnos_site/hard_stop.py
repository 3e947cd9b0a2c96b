"""The last resort of a stop: end the process when its clean shutdown overruns.

A SIGTERM drains (hypnos_site/serve.py, `manage.py runinference`): the requests in flight get
`server.shutdown_drain_secs`, then the worker cancels what still runs and joins its engine
threads. A thread inside a native call that never looks at its cancel flag (a stable-diffusion.cpp
generation, a runaway grammar in llama.cpp, a wedged driver) would hold that join, and the
interpreter's exit, forever: the process manager's SIGKILL would be the only way out. So the
drain arms a timer that ends the process with os._exit once the drain and
`server.shutdown_grace_secs` have passed, whatever runs; the log names the threads it cut.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("hypnos.shutdown")

# The exit status of a cut shutdown: not 0, since the process did not stop cleanly.
CUT_EXIT_CODE = 1

_armed: threading.Timer | None = None
_lock = threading.Lock()


def exit_after(secs: float) -> None:
    """End this process with CUT_EXIT_CODE in `secs` unless it has exited by then. Once per
    process: a second call (a second SIGTERM) keeps the first deadline."""
    global _armed
    with _lock:
        if _armed is not None:
            return
        _armed = threading.Timer(secs, _cut, args=(secs,))
        _armed.name = "hypnos-hard-stop"
        # A daemon thread: it must not hold the interpreter's exit itself.
        _armed.daemon = True
        _armed.start()


def _cut(secs: float) -> None:
    running = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.current_thread())
    log.error(
        "still running %.0f s after the stop began (threads: %s): exiting now",
        secs,
        ", ".join(running) or "none",
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(CUT_EXIT_CODE)
