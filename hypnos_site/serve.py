"""`python -m hypnos_site.serve`: run daphne on the configured host, port and TLS."""

from __future__ import annotations

import os
import sys

from daphne.cli import CommandLineInterface

from hypnos_site import edge
from hypnos_site.config import ConfigError, get_config


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
    except ConfigError as exc:
        sys.exit(f"hypnos: {exc}")
    # Before daphne builds its first request: bodies are capped while they stream in (edge.py).
    edge.install()
    # -v 0: no access log of daphne's own; inference.middleware writes one line per request on
    # `hypnos.access` (plain or JSON, server.log_format).
    CommandLineInterface().run(["-v", "0", "--application-close-timeout", "30", *args])


if __name__ == "__main__":
    main()
