"""`manage.py runinference`: the inference worker of the distributed deployment.

By default the command is a small supervisor: the worker itself runs in a child process
(`runinference --no-supervise`), and a child killed by a signal (a segfault in an engine's native
code, SIGKILL, the OOM killer) is started again after a backoff. Requests in flight on the dead
worker end on the web side within the reply deadline (inference/transport/client.py), with an error chunk
in a stream and a 503 otherwise. SIGTERM / SIGINT go to the child, which drains and exits (at the latest
`server.shutdown_grace_secs` after the drain, whatever still runs: hypnos_site/hard_stop.py); a
child that exits by itself (an error at start-up, a clean stop) ends the supervisor with its code.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import subprocess
import sys
import time
from types import FrameType

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand

from hypnos_site import taskdump
from hypnos_site.config import BASE_DIR
from hypnos_site.hard_stop import exit_after
from inference.worker import Worker
from inference.worker.channel_server import ChannelServer
from models_registry.overlay import with_overlay

log = logging.getLogger(__name__)
FIRST_BACKOFF_SECS = 0.5
MAX_BACKOFF_SECS = 30.0
# A child that ran this long before it died was healthy: the backoff starts over.
HEALTHY_SECS = 60.0
PR_SET_PDEATHSIG = 1


class Command(BaseCommand):
    help = "Run the inference worker: hold the engines and serve requests from the channel layer."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument(
            "--no-supervise",
            dest="supervise",
            action="store_false",
            help="run the worker in this process, without a supervisor that restarts it when it dies by a signal",
        )
        parser.add_argument(
            "--restart-delay",
            type=float,
            default=FIRST_BACKOFF_SECS,
            metavar="SECS",
            help="the supervisor's wait before restarting a worker that died by a signal, doubled after "
            f"each quick death (default {FIRST_BACKOFF_SECS:g})",
        )

    def handle(self, *args, **options):  # type: ignore[no-untyped-def]
        if options["supervise"]:
            command = [sys.executable, str(BASE_DIR / "manage.py"), "runinference", "--no-supervise"]
            sys.exit(Supervisor(command, first_backoff=options["restart_delay"]).run())
        asyncio.run(self._main())

    async def _main(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        drain_secs = settings.HYPNOS.server.shutdown_drain_secs
        cut_after = drain_secs + settings.HYPNOS.server.shutdown_grace_secs
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stop, stop, cut_after)
        taskdump.install(lambda: loop, loop.call_soon_threadsafe)
        # The pool: the config file's models with the run-time changes kept in the database.
        worker = Worker(await sync_to_async(with_overlay)(settings.HYPNOS))
        worker.start()
        server = ChannelServer(worker, get_channel_layer(), drain_secs=drain_secs)
        try:
            await server.serve(stop)
        finally:
            log.info("inference worker stopping")
            await loop.run_in_executor(None, worker.shutdown)


def _stop(stop: asyncio.Event, cut_after: float) -> None:
    """SIGTERM / SIGINT: drain, and whatever still runs after the drain and the grace (an engine
    in a native call that does not look at its cancel flag), the process ends then
    (hypnos_site/hard_stop.py)."""
    stop.set()
    exit_after(cut_after)


class Supervisor:
    """Runs `command` and starts it again whenever it dies by a signal."""

    def __init__(self, command: list[str], first_backoff: float = FIRST_BACKOFF_SECS):
        self.command = command
        self.first_backoff = first_backoff
        self.child: subprocess.Popen[bytes] | None = None
        # Set by the signal handler (so a plain flag: no lock a handler could meet held).
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._forward)
        backoff = self.first_backoff
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.command, preexec_fn=_die_with_parent)
            log.info("inference worker process %d started", self.child.pid)
            code = self.child.wait()
            if self.stopping:
                return max(code, 0)
            if code >= 0:
                log.info("inference worker process %d exited with %d", self.child.pid, code)
                return code
            if time.monotonic() - started >= HEALTHY_SECS:
                backoff = self.first_backoff
            log.error(
                "inference worker process %d died by %s; restarting it in %.1f s",
                self.child.pid,
                _signal_name(-code),
                backoff,
            )
            if self._sleep(backoff):
                return 0
            backoff = min(backoff * 2, MAX_BACKOFF_SECS)

    def _sleep(self, secs: float) -> bool:
        """Sleep `secs` unless told to stop; whether told to stop."""
        until = time.monotonic() + secs
        while not self.stopping and time.monotonic() < until:
            time.sleep(0.05)
        return self.stopping

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
