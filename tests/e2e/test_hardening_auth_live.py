"""Issue 12, authorisation over real sockets: daphne (embedded deployment, SQLite) with an admin
key and a plain one. The realtime socket's close code is daphne's and autobahn's business, which
channels' in-process communicator never reaches; a disconnect is a closed TCP connection. The
server is the suite's shared `keyed` one (tests/e2e/conftest.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2e.conftest import KEYED_PLAIN as PLAIN
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_a_bad_key_on_the_realtime_socket_closes_it_with_1008(keyed: Server):
    url = keyed.base_url.replace("http://", "ws://") + "/v1/realtime?intent=transcription&api_key=sk-wrong"
    with connect(url) as ws:
        event = json.loads(ws.recv(timeout=10))
        assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as closed:
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": ""}))
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert "Exception" not in keyed.procs[0].tail(200)


def test_a_plain_key_is_refused_the_admin_routes_over_http(keyed: Server):
    for method, path in [
        ("POST", "/v1/models/smollm2-135m/disable"),
        ("DELETE", "/v1/logs"),
        ("POST", "/api/v1/unload"),
        ("POST", "/v1/logs/level"),
    ]:
        response = httpx.request(method, keyed.base_url + path, headers=bearer(PLAIN), json={"level": "trace"})
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["type"] == "permission_denied"
        assert response.headers["x-request-id"].startswith("req-")
    model = httpx.get(f"{keyed.base_url}/v1/models/smollm2-135m", headers=bearer(PLAIN)).json()
    assert model["enabled"] is True


def test_a_stream_the_client_closes_is_logged_with_what_it_delivered(keyed: Server):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Tell a long story about a dragon."}],
        "max_tokens": 200,
        "stream": True,
    }
    received = 0
    with httpx.stream(
        "POST", f"{keyed.base_url}/v1/chat/completions", headers=bearer(PLAIN), json=body, timeout=60
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                received += 1
            if received == 5:
                break
    deadline = time.monotonic() + 30
    while (record := httpx.get(f"{keyed.base_url}/v1/logs/{request_id}", headers=bearer(PLAIN))).status_code == 404:
        assert time.monotonic() < deadline, "the dropped stream was not logged"
        time.sleep(0.1)
    logged = record.json()
    assert (logged["status"], logged["finish_reason"], logged["key"]) == (200, "cancelled", "plain")
    # The server may have written a few more chunks into the socket before it saw the close.
    assert 5 <= logged["tokens_out"] < 200
