"""hypnos_site/hard_stop.py: a process whose thread is stuck in a native call still ends once
the armed deadline passes, with the threads it cut in the log (the wiring into a SIGTERM of the
distributed worker: tests/e2e/test_hardening_faults.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from hypnos_site.config import BASE_DIR
from hypnos_site.hard_stop import CUT_EXIT_CODE

STUCK = """
import ctypes, logging, threading
from hypnos_site.hard_stop import exit_after

logging.basicConfig(level=logging.INFO)

def native_call():
    libc = ctypes.CDLL(None)
    while True:
        libc.sleep(3600)

threading.Thread(target=native_call, name="engine-thread").start()
exit_after(0.5)
exit_after(3600)  # a second stop keeps the first deadline
print("main thread done", flush=True)
"""


def test_a_thread_stuck_in_a_native_call_does_not_hold_the_exit():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK], cwd=BASE_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == CUT_EXIT_CODE, done.stderr
    assert "main thread done" in done.stdout
    assert "exiting now" in done.stderr and "engine-thread" in done.stderr
    # Armed at 0.5 s: far from the second call's hour, whatever the machine's load.
    assert time.monotonic() - started < 30
