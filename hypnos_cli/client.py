"""The CLI's side of HTTP: one httpx client per command, the server's errors turned into CliError
with the server's own message."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:9999"
CONNECT_TIMEOUT_SECS = 5.0
# Reads of state (models, memory, logs, keys) answer at once.
READ_TIMEOUT_SECS = 30.0
# What may wait on a model load or a long answer: spec §17 asks clients to wait at least the
# server's limits.request_timeout_secs (900 s by default).
LONG_TIMEOUT_SECS = 900.0
LONG = httpx.Timeout(LONG_TIMEOUT_SECS, connect=CONNECT_TIMEOUT_SECS)
KEY_HINT = " (pass --key or set HYPNOS_API_KEY)"


def cli_version() -> str:
    try:
        return version("hypnos")
    except PackageNotFoundError:
        return "dev"


class CliError(Exception):
    """What the command prints on stderr before it exits with status 1."""


def error_message(response: httpx.Response) -> str:
    """The server's own message: `{"error": {"message"}}` on /v1, `{"error": "<message>"}` on
    the Ollama routes; else the status and the start of the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        message = str(error["message"])
    elif isinstance(error, str) and error:
        message = error
    else:
        text = response.text.strip()[:200]
        message = f"HTTP {response.status_code} from {response.request.url}" + (f": {text}" if text else "")
    return message + KEY_HINT if response.status_code == 401 else message


class Server:
    """A running Hypnos server at `url`, called with `key` as a Bearer token when there is one."""

    def __init__(self, url: str, key: str | None):
        self.url = url.rstrip("/")
        headers = {"User-Agent": f"hypnos-cli/{cli_version()}"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(READ_TIMEOUT_SECS, connect=CONNECT_TIMEOUT_SECS)
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def get(self, path: str, params: dict[str, Any] | None = None, allow: tuple[int, ...] = ()) -> Any:
        return self.call("GET", path, params=params, allow=allow)

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout: httpx.Timeout | None = None,
        allow: tuple[int, ...] = (),
    ) -> Any:
        """The JSON answer of one call; CliError for an error status (but those in `allow`)."""
        with self._transport_errors():
            response = self.http.request(
                method, path, json=body, params=params, timeout=timeout or httpx.USE_CLIENT_DEFAULT
            )
        if response.status_code >= 400 and response.status_code not in allow:
            raise CliError(error_message(response))
        try:
            return response.json()
        except ValueError:
            message = f"{self.url}{path} answered with something that is not JSON: is it a Hypnos server?"
            raise CliError(message) from None

    @contextmanager
    def stream(self, method: str, path: str, body: Any) -> Iterator[Iterator[str]]:
        """The answer's lines as they arrive (SSE or NDJSON). An error status before the first
        byte is a CliError; leaving the block closes the connection, which stops the server's
        work at its next token or chunk."""
        with self._transport_errors(), self.http.stream(method, path, json=body, timeout=LONG) as response:
            if response.status_code >= 400:
                response.read()
                raise CliError(error_message(response))
            yield response.iter_lines()

    @contextmanager
    def _transport_errors(self) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise CliError(f"no Hypnos server answers at {self.url} — start one with ./run.sh") from exc
        except httpx.TransportError as exc:
            raise CliError(f"the server at {self.url} stopped answering: {exc or type(exc).__name__}") from exc
