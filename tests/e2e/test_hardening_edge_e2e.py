"""Issue 12, the HTTP edge through a real daphne (`python -m hypnos_site.serve`, embedded, the
real SmolLM2) over raw sockets: bodies are refused while they stream in, chunked bodies under
the limit are read whole, and what twisted used to answer itself is the spec's envelope."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server, embedded_server

pytestmark = pytest.mark.e2e
LIMIT = 64 * 1024
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def capped(tmp_path_factory) -> Iterator[Server]:
    """The embedded server with limits.max_body_bytes = 64 KiB."""
    with embedded_server(
        "edge",
        tmp_path_factory.mktemp("edge"),
        lambda text: text.replace("[limits]\n", f"[limits]\nmax_body_bytes = {LIMIT}\n", 1),
    ) as server:
        yield server


def open_socket(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])), timeout=10)
    return sock


def head(path: str, *headers: str, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), body (by Content-Length, or chunked)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    chunked = headers.get("transfer-encoding") == "chunked"
    while (not body.endswith(b"0\r\n\r\n")) if chunked else len(body) < int(headers.get("content-length", 0)):
        more = sock.recv(65536)
        assert more, "connection closed inside the body"
        body += more
    return status, headers, _unchunk(body) if chunked else body


def _unchunk(data: bytes) -> bytes:
    body = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        if int(size, 16) == 0:
            return body
        body, data = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_a_content_length_above_the_limit_is_a_413_before_the_body_is_sent(capped):
    with open_socket(capped) as sock:
        sock.sendall(head("/v1/chat/completions", "Content-Type: application/json", f"Content-Length: {1 << 30}"))
        status, headers, body = read_response(sock)  # not one byte of the body was sent
        assert status == 413
        assert headers["content-type"].startswith("text/plain")
        assert headers["x-request-id"].startswith("req-")
        assert f"limits.max_body_bytes ({LIMIT})" in body.decode()
        assert closed_by_server(sock)


def test_a_client_that_expects_100_continue_gets_the_413_instead(capped):
    with open_socket(capped) as sock:
        sock.sendall(
            head(
                "/v1/chat/completions",
                "Content-Type: application/json",
                f"Content-Length: {LIMIT + 1}",
                "Expect: 100-continue",
            )
        )
        status, _, _ = read_response(sock)
        assert status == 413
        assert closed_by_server(sock)


def test_a_multipart_upload_above_the_limit_gets_the_json_413(capped):
    with open_socket(capped) as sock:
        sock.sendall(
            head(
                "/v1/audio/transcriptions",
                "Content-Type: multipart/form-data; boundary=b",
                f"Content-Length: {LIMIT * 4}",
            )
        )
        status, headers, body = read_response(sock)
        assert status == 413 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_a_chunked_body_is_refused_at_the_limit_and_the_connection_closed(capped):
    with open_socket(capped) as sock:
        sock.sendall(head("/v1/chat/completions", "Content-Type: application/json", "Transfer-Encoding: chunked"))
        piece = b" " * (16 * 1024)
        sent = 0
        while sent <= LIMIT:  # the body would go on for a GiB; it stops one chunk past the limit
            sock.sendall(chunk(piece))
            sent += len(piece)
        status, headers, body = read_response(sock)
        assert status == 413 and headers["x-request-id"].startswith("req-")
        assert "limits.max_body_bytes" in body.decode()
        assert closed_by_server(sock)


def test_a_chunked_body_under_the_limit_is_read_whole(capped):
    payload = json.dumps(CHAT).encode()
    with open_socket(capped) as sock:
        sock.sendall(head("/v1/chat/completions", "Content-Type: application/json", "Transfer-Encoding: chunked"))
        for start in range(0, len(payload), 7):
            sock.sendall(chunk(payload[start : start + 7]))
        sock.sendall(b"0\r\n\r\n")
        sock.settimeout(120)
        status, _, body = read_response(sock)
    assert status == 200, body[:300]
    chunked = json.loads(body)
    plain = httpx.post(f"{capped.base_url}/v1/chat/completions", json=CHAT, timeout=120).json()
    assert chunked["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > 20
    assert chunked["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_a_chunked_body_of_exactly_the_limit_passes_the_edge(capped):
    bare = len(json.dumps(CHAT | {"user": ""}))
    body = json.dumps(CHAT | {"user": "x" * (LIMIT - bare)}).encode()
    assert len(body) == LIMIT
    with open_socket(capped) as sock:
        sock.sendall(head("/v1/chat/completions", "Content-Type: application/json", "Transfer-Encoding: chunked"))
        sock.sendall(chunk(body) + b"0\r\n\r\n")
        sock.settimeout(120)
        status, _, answer = read_response(sock)
    assert status == 200, answer[:300]


def test_multipart_without_a_boundary_is_a_400_in_the_envelope(capped):
    with open_socket(capped) as sock:
        sock.sendall(
            head("/v1/audio/transcriptions", "Content-Type: multipart/form-data", "Content-Length: 9") + b"--x\r\n--x--"
        )
        status, headers, body = read_response(sock)
    assert status == 400
    assert headers["content-type"] == "application/json" and headers["x-request-id"].startswith("req-")
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "boundary" in error["message"]


def test_json_nested_30000_deep_is_a_400(capped):
    body = ("[" * 30_000 + "]" * 30_000).encode()  # under the 64 KiB limit
    with open_socket(capped) as sock:
        sock.sendall(
            head("/v1/chat/completions", "Content-Type: application/json", f"Content-Length: {len(body)}") + body
        )
        status, _, answer = read_response(sock)
    assert status == 400
    assert "deeper than 64 levels" in json.loads(answer)["error"]["message"]


def test_a_rebinding_host_is_a_400_in_the_envelope(capped):
    response = httpx.get(f"{capped.base_url}/v1/models", headers={"host": "rebind.attacker.example:9999"})
    assert response.status_code == 400 and response.headers["x-request-id"].startswith("req-")
    assert response.json()["error"]["code"] == "disallowed_host"
    assert httpx.get(f"{capped.base_url}/v1/models", headers={"host": "localhost"}).status_code == 200


def test_the_realtime_handshake_refuses_a_foreign_origin(capped):
    url = capped.base_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="https://attacker.example", open_timeout=10)
    assert refused.value.response.status_code == 403
    with connect(url, origin="http://localhost:5173", open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"
    with connect(url, open_timeout=10) as ws:  # no Origin: not a browser
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"


NUL_BODIES = [
    ("/v1/chat/completions", CHAT | {"model": "smollm2\u0000-135m"}),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "Hi\u0000"}], "user": "\u0000"}),
    ("/v1/embeddings", {"model": "all-minilm\u0000", "input": "Hi"}),
    ("/v1/models/smollm2%00/options", {"temperature": 0.5}),
    ("/v1/memory/tier", {"model": "smollm2-135m\u0000", "target_tier": "tier2_pinned_ram"}),
    ("/api/v1/load", {"model_name": "smollm2\u0000"}),
]


@pytest.mark.parametrize(("path", "body"), NUL_BODIES)
def test_nul_characters_never_reach_postgresql_as_a_500(distributed, path, body):
    # PostgreSQL refuses NUL in text; the request log and the pool overlay write these strings.
    response = httpx.post(f"{distributed.base_url}{path}", json=body, timeout=120)
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    log = httpx.get(f"{distributed.base_url}/v1/logs", params={"limit": 1}, timeout=10)
    assert log.status_code == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        head("/v1/models", "X-Thing: a\x00b", method="GET"),  # NUL in a header value (twisted)
        head("/v1/chat/completions", "Content-Type: application/json", "Transfer-Encoding: chunked") + b"zz\r\n",
        b"GET /v1/models HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
        head("/v1/models?q=\xff", method="GET"),  # not ASCII (daphne's own check)
    ],
)
def test_what_the_http_layer_cannot_parse_is_a_400_in_the_envelope(capped, request_bytes):
    with open_socket(capped) as sock:
        sock.sendall(request_bytes)
        status, headers, body = read_response(sock)
    assert status == 400
    assert headers["content-type"] == "application/json" and headers["x-request-id"].startswith("req-")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
