"""`python -m hypnos_site.serve`: run daphne on the configured host, port and TLS.

SIGTERM drains (what a process manager or a rolling deploy sends): the process stops listening
at once, so new connections go to the other web processes, lets the requests in flight finish
(streams to their last byte) for up to `server.shutdown_drain_secs`, then exits 0 (or 1 when
the engines' shutdown overruns its grace: hypnos_site/hard_stop.py). SIGINT
(Ctrl-C) still stops at once. SIGUSR1 logs what every request is waiting on (hypnos_site/taskdump.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import FrameType
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.server import Server
from twisted.internet import reactor

from hypnos_site import edge, taskdump
from hypnos_site.config import ConfigError, get_config
from hypnos_site.hard_stop import exit_after

log = logging.getLogger("hypnos.serve")
DRAIN_POLL_SECS = 0.1


class DrainingServer(Server):
    """daphne's server with SIGTERM draining."""

    def __init__(self, *args: Any, drain_secs: float = 30.0, grace_secs: float = 15.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drain_secs = drain_secs
        self.grace_secs = grace_secs
        self.ports: list[Any] = []
        self.draining_since: float | None = None

    def run(self) -> None:
        # Twisted binds reactor.sigTerm as the SIGTERM handler when the reactor starts.
        reactor.sigTerm = self._sigterm  # type: ignore[attr-defined]
        taskdump.install(lambda: reactor._asyncioEventloop, reactor.callFromThread)  # type: ignore[attr-defined]
        super().run()

    def listen_success(self, port: Any) -> None:
        self.ports.append(port)
        # A WebSocket message over websocket_max_message_size (1 MiB): close with 1009 (message
        # too big) and a closing handshake, as RFC 6455 says, instead of autobahn's default of
        # dropping the TCP connection, which a client sees as a network error with no reason.
        self.ws_factory.setProtocolOptions(failByDrop=False)
        super().listen_success(port)

    def _sigterm(self, number: int, frame: FrameType | None = None) -> None:
        reactor.callFromThread(self.drain)  # type: ignore[attr-defined]

    def in_flight(self) -> int:
        return sum(
            1
            for details in self.connections.values()
            if details.get("application_instance") is not None and not details["application_instance"].done()
        )

    def drain(self) -> None:
        if self.draining_since is not None:
            return
        self.draining_since = time.monotonic()
        # The in-process worker's engine threads are joined at exit: one in a native call that
        # never returns must not keep the process past the drain (hypnos_site/hard_stop.py).
        exit_after(self.drain_secs + self.grace_secs)
        for port in self.ports:
            port.stopListening()
        log.warning(
            "SIGTERM: no longer accepting connections; letting %d request(s) finish (up to %.0f s)",
            self.in_flight(),
            self.drain_secs,
        )
        self._stop_when_drained()

    def _stop_when_drained(self) -> None:
        assert self.draining_since is not None
        waited = time.monotonic() - self.draining_since
        left = self.in_flight()
        if left and waited < self.drain_secs:
            reactor.callLater(DRAIN_POLL_SECS, self._stop_when_drained)  # type: ignore[attr-defined]
            return
        if left:
            log.warning("drain timeout: %d request(s) still running are cut", left)
        else:
            log.warning("drained in %.1f s; stopping", waited)
        self.stop()


def daphne_args() -> list[str]:
    server = get_config().server
    if server.tls:
        host = server.host.replace(":", r"\:")
        endpoint = f"ssl:{server.port}:privateKey={server.tls.key}:certKey={server.tls.cert}:interface={host}"
        return ["-e", endpoint, "hypnos_site.asgi:application"]
    return ["-b", server.host, "-p", str(server.port), "hypnos_site.asgi:application"]


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypnos_site.settings")
    try:
        args = daphne_args()
        server = get_config().server
    except ConfigError as exc:
        sys.exit(f"hypnos: {exc}")
    # Before daphne builds its first request: bodies are capped while they stream in (edge.py).
    edge.install()

    class Cli(CommandLineInterface):
        def server_class(self, *a: Any, **kw: Any) -> DrainingServer:  # type: ignore[override]
            return DrainingServer(
                *a, drain_secs=server.shutdown_drain_secs, grace_secs=server.shutdown_grace_secs, **kw
            )

    # -v 0: no access log of daphne's own; inference.web.common.middleware writes one line per request on
    # `hypnos.access` (plain or JSON, server.log_format).
    Cli().run(["-v", "0", "--application-close-timeout", "30", *args])


if __name__ == "__main__":
    main()
