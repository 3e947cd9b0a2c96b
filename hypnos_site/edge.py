"""The HTTP edge inside daphne: request bodies are capped while they stream in.

Daphne (a twisted.web server) reads the whole request body, into memory or a temporary file,
before the ASGI application sees a byte of it, so a limit checked in Django comes after a 1 GiB
upload has arrived and been spooled to disk. `CappedWebRequest` replaces daphne's request class
(`install`, called by hypnos_site.serve before daphne starts serving) and refuses, with 413:

- a declared Content-Length above `limits.max_body_bytes` as soon as the headers are read
  (before any 100 Continue, so a client that asked for one never sends the body);
- a chunked body the moment its bytes pass the limit.

The refusal is written straight to the connection, whose write side is then closed; what the
client still sends is read and dropped for a moment (so it sees the answer instead of a reset)
and the connection is aborted after that. A chunked body under the limit reaches Django with its
real Content-Length: Django's ASGIRequest reads exactly CONTENT_LENGTH bytes, so without it a
chunked body read as empty. Twisted's own form parsing is turned off: daphne never uses it, it
read multipart bodies into memory a second time and answered a multipart body without a
boundary with a bare 400 that no middleware could shape.
"""

from __future__ import annotations

import json

from daphne import http_protocol
from twisted.internet import interfaces
from twisted.web import http

from hypnos_site.config import get_config

# How long a refused connection keeps reading (and dropping) what the client still sends, so a
# client that writes its whole body before reading still gets the 413 instead of a reset.
LINGER_SECS = 2.0

_OriginalWebRequest = http_protocol.WebRequest


class CappedWebRequest(_OriginalWebRequest):
    """daphne's WebRequest with the body limit applied while the body arrives."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.setdefault("parsePOSTFormSubmission", False)
        self.max_body_bytes = get_config().limits.max_body_bytes
        self._body_bytes = 0
        self._chunked = False
        self._refused = False
        super().__init__(*args, **kwargs)

    def gotLength(self, length: int | None) -> None:
        # Twisted calls this once the headers are in: None means a chunked body.
        if length is not None and length > self.max_body_bytes:
            self._refuse(f"Request body of {length} bytes exceeds limits.max_body_bytes ({self.max_body_bytes}).")
            return
        self._chunked = length is None
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(data)
        if self._body_bytes > self.max_body_bytes:
            self._refuse(f"Request body exceeds limits.max_body_bytes ({self.max_body_bytes}): refused at that size.")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            return
        if self._chunked:
            self.requestHeaders.removeHeader(b"Transfer-Encoding")
            self.requestHeaders.setRawHeaders(b"Content-Length", [b"%d" % self.content.tell()])
        super().requestReceived(command, path, version)

    def basic_error(self, status: int, status_text: bytes, body: str) -> None:
        """daphne's own refusals (an invalid header, path or query string; an application that
        failed or timed out) in the envelope instead of an HTML page."""
        from inference.web.common.middleware import new_request_id  # here: it imports Django, set up by then

        kind = "invalid_request_error" if status < 500 else "server_error"
        headers = [(b"Content-Type", b"application/json"), (b"x-request-id", new_request_id().encode())]
        self.handle_reply({"type": "http.response.start", "status": status, "headers": headers})
        self.handle_reply({"type": "http.response.body", "body": _envelope(f"{body}.", kind)})

    def _refuse(self, message: str) -> None:
        self._refused = True
        # allHeadersReceived sends 100 Continue after gotLength when asked: not after a refusal.
        self.requestHeaders.removeHeader(b"Expect")
        if self.content is not None:
            self.content.close()
            self.content = None
        channel = self.channel
        channel.transport.write(_too_large(message, self.requestHeaders.getRawHeaders(b"Content-Type", [b""])[0]))
        _close_after_linger(channel)


def _too_large(message: str, content_type: bytes) -> bytes:
    """The 413 of spec §4: plain text, or the JSON envelope for a multipart upload."""
    if content_type.lower().startswith(b"multipart/form-data"):
        return _response(b"413 Content Too Large", _envelope(message, "payload_too_large"), b"application/json")
    return _response(b"413 Content Too Large", message.encode(), b"text/plain; charset=utf-8")


def _envelope(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}}).encode()


def _response(status: bytes, body: bytes, media: bytes) -> bytes:
    from inference.web.common.middleware import new_request_id  # here: it imports Django, set up by then

    head = [
        b"HTTP/1.1 " + status,
        b"Content-Type: " + media,
        b"Content-Length: %d" % len(body),
        b"x-request-id: " + new_request_id().encode(),
        b"Connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _bad_request(channel: http.HTTPChannel) -> None:
    """What twisted answers a request it cannot parse (a NUL or line break in a header value, a
    malformed request line or chunk): the spec's envelope with an x-request-id instead of a bare
    `400 Bad Request` with no body."""
    message = "The request is not valid HTTP/1.1 (its request line, a header or the chunked encoding)."
    body = _envelope(message, "invalid_request_error")
    channel.transport.write(_response(b"400 Bad Request", body, b"application/json"))
    channel.loseConnection()


def _close_after_linger(channel: object) -> None:
    transport = channel.transport  # type: ignore[attr-defined]
    # Nothing the client sends on this connection is parsed any more.
    channel.dataReceived = lambda data: None  # type: ignore[attr-defined]
    if interfaces.ISSLTransport.providedBy(transport):
        transport.loseConnection()  # TLS: close_notify after the answer, no half-close
    else:
        transport.loseWriteConnection()  # the answer, then FIN; reading goes on
    from twisted.internet import reactor  # here: daphne.server installs the asyncio reactor first

    reactor.callLater(LINGER_SECS, transport.abortConnection)


def install() -> None:
    """Make daphne build CappedWebRequest for every HTTP request, and twisted answer what it
    cannot parse in the envelope. daphne's HTTPFactory looks the module's `WebRequest` up each
    time it builds a protocol, so replacing that name before the server starts is enough;
    `_respondToBadRequestAndDisconnect` is twisted's one place for its bare 400s (this process
    serves nothing else with twisted)."""
    http_protocol.WebRequest = CappedWebRequest  # type: ignore[misc]
    http.HTTPChannel._respondToBadRequestAndDisconnect = _bad_request  # type: ignore[method-assign]
