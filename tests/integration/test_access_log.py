"""One log line per request on `hypnos.access` (issue 17 item 9): its id, route, model, status,
duration and tokens; the client's own id kept beside the server's; JSON with log_format json."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from hypnos_site.config import BASE_DIR
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = {"model": "smollm2-135m", "messages": PARIS_MESSAGES, "max_tokens": 2, "temperature": 0}


async def test_every_request_logs_one_line_with_what_it_cost(api, caplog):
    caplog.set_level(logging.INFO, logger="hypnos.access")
    response = await post_json(api, "/v1/chat/completions", CHAT, **{"x-client-request-id": "job-42/step-1"})
    assert response["x-client-request-id"] == "job-42/step-1"
    assert response["x-request-id"].startswith("req-")
    [line] = [r for r in caplog.records if r.name == "hypnos.access" and r.path == "/v1/chat/completions"]
    usage = response.json()["usage"]
    assert line.request_id == response["x-request-id"] and line.status == 200 and line.model == "smollm2-135m"
    assert (line.prompt_tokens, line.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert line.client_request_id == "job-42/step-1" and line.duration_ms > 0
    assert line.getMessage().startswith("POST /v1/chat/completions request_id=req-")
    # A tracing proxy's X-Request-Id is kept as the client's id; the server's own id stays its own.
    traced = await api.get("/v1/models", headers={"x-request-id": "trace-7f3a"})
    assert traced["x-client-request-id"] == "trace-7f3a" and traced["x-request-id"].startswith("req-")
    assert any(r.path == "/v1/models" and r.status == 200 for r in caplog.records if r.name == "hypnos.access")


async def test_a_stream_logs_its_line_when_it_ends_and_a_bad_client_id_is_dropped(api, caplog):
    caplog.set_level(logging.INFO, logger="hypnos.access")
    response = await post_json(api, "/v1/chat/completions", CHAT | {"stream": True}, **{"x-request-id": "x" * 200})
    assert not [r for r in caplog.records if r.name == "hypnos.access"]  # headers out, body not yet
    b"".join([chunk async for chunk in response.streaming_content])
    [line] = [r for r in caplog.records if r.name == "hypnos.access"]
    assert line.completion_tokens > 0 and not hasattr(line, "client_request_id")
    assert "x-client-request-id" not in response


def test_log_format_json_writes_each_record_as_a_json_object(tmp_path):
    config = tmp_path / "hypnos.toml"
    config.write_text('[server]\nlog_format = "json"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPNOS_")}
    env.update(HYPNOS_CONFIG=str(config), HYPNOS_DATA_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="hypnos_site.settings")
    code = (
        "import django, logging; django.setup(); "
        "logging.getLogger('hypnos.access').info('GET /v1/models', extra={'status': 200, 'request_id': 'req-1'})"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env, capture_output=True, text=True)
    line = json.loads(done.stderr.strip().splitlines()[-1])
    assert line["message"] == "GET /v1/models" and line["status"] == 200 and line["logger"] == "hypnos.access"
    assert line["level"] == "INFO" and "time" in line
