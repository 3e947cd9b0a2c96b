"""A batch outlives its server: an embedded server killed (SIGKILL) in the middle of a batch and
started again finishes it, every custom_id answered exactly once, in input order."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import embedded_server, start, wait_ready

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"
LINES = 24
WAIT_SECS = 300


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_batch_whose_server_is_killed_finishes_after_the_restart_with_no_line_lost_or_doubled(tmp_path: Path):
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}],
                "max_tokens": 24,
                "temperature": 0,
            },
        }
        for i in range(LINES)
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with embedded_server("batch-restart", tmp_path) as server:
        client = sdk(server.base_url)
        batch = client.batches.create(
            input_file_id=client.files.create(file=source.open("rb"), purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        deadline = time.monotonic() + WAIT_SECS
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [web] = server.procs
        web.popen.send_signal(signal.SIGKILL)
        web.popen.wait(30)
        assert client is not None and web.popen.returncode == -signal.SIGKILL
        again = start("daphne-batch-restart-2", ["-m", "hypnos_site.serve"], server.env, tmp_path)
        try:
            wait_ready(server.base_url, again)
            while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline + WAIT_SECS, batch
                time.sleep(0.25)
            assert batch.status == "completed", batch
            assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
            output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
            assert [line["custom_id"] for line in output] == [f"line-{i}" for i in range(LINES)]
            assert len({line["response"]["request_id"] for line in output}) == LINES
            assert "resuming batch" in again.log.read_text()
        finally:
            again.stop()
