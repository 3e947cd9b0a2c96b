"""The `hypnos` CLI's own logic (issue 17): it imports nothing of the server, reads its options
on either side of the verb, and prints the server's error messages and byte counts as a person
reads them. tests/e2e/test_cli_e2e.py runs the command against a live server."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from hypnos_cli.client import error_message
from hypnos_cli.main import build_parser
from hypnos_cli.output import duration, size, table
from tests.unit.test_dependencies import APPS, DJANGO


def test_it_imports_no_app_of_the_server_and_no_django():
    probe = "import sys, hypnos_cli.main; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = set(
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    )
    assert "httpx" in loaded and loaded.isdisjoint({*APPS, *DJANGO})


def test_it_reads_the_global_options_before_and_after_the_verb():
    before = build_parser().parse_args(["--url", "http://h:1", "--json", "ps"])
    after = build_parser().parse_args(["ps", "--url", "http://h:1", "--json", "--all"])
    assert (before.url, before.json, after.url, after.json, after.all) == ("http://h:1", True, "http://h:1", True, True)
    plain = build_parser().parse_args(["keys", "revoke", "ci-bot"])
    assert (plain.url, plain.key, plain.json, plain.keys_verb, plain.name) == (None, None, False, "revoke", "ci-bot")


def test_it_prints_the_servers_message_in_either_error_shape():
    request = httpx.Request("GET", "http://h:1/v1/x")
    v1 = httpx.Response(404, json={"error": {"message": "no such model", "type": "model_not_found"}}, request=request)
    ollama = httpx.Response(404, json={"error": "model 'x' not found"}, request=request)
    refused = httpx.Response(401, json={"error": {"message": "Missing API key."}}, request=request)
    html = httpx.Response(502, text="<html>bad gateway</html>", request=request)
    assert [error_message(r) for r in (v1, ollama, refused, html)] == [
        "no such model",
        "model 'x' not found",
        "Missing API key. (pass --key or set HYPNOS_API_KEY)",
        "HTTP 502 from http://h:1/v1/x: <html>bad gateway</html>",
    ]


def test_it_writes_sizes_durations_and_aligned_tables():
    assert [size(n) for n in (0, 812 * 1024, 106_250_000, 8 << 30, None)] == [
        "0 B",
        "812 KiB",
        "101.3 MiB",
        "8.0 GiB",
        "-",
    ]
    assert [duration(s) for s in (4.7, 133, 3 * 3600 + 300, 2 * 86400 + 4 * 3600)] == ["4s", "2m13s", "3h05m", "2d4h"]
    assert table(["ID", "TIER"], [["smollm2-135m", "1 vram"], ["x", "3 disk"]]).splitlines() == [
        "ID            TIER",
        "smollm2-135m  1 vram",
        "x             3 disk",
    ]


def test_load_waits_for_a_move_the_server_answered_202_until_the_model_is_there(monkeypatch, capsys):
    """POST /v1/memory/tier answers 202 when the move outlasts request_timeout_secs (it goes on):
    `hypnos load` then polls GET /v1/memory/status until the model is in its tier."""
    from hypnos_cli import commands
    from hypnos_cli.client import Server

    calls: list[str] = []
    tiers = iter(["tier2_pinned_ram", "tier2_pinned_ram", "tier1_gpu_vram"])

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/memory/tier":
            moving = {"model": "m", "target_tier": "tier1_gpu_vram", "status": "moving", "message": "..."}
            return httpx.Response(202, json=moving, headers={"Location": "/v1/memory/status"})
        placement = {"vram_weight_bytes": 1 << 20, "allocated_context_len": 2048}
        return httpx.Response(200, json={"models": [{"id": "m", "current_tier": next(tiers), "placement": placement}]})

    monkeypatch.setattr(commands, "MOVE_POLL_SECS", 0.0)
    server = Server("http://h:1", None)
    server.http = httpx.Client(base_url="http://h:1", transport=httpx.MockTransport(answer))
    args = build_parser().parse_args(["load", "m"])
    assert commands.do_load(server, args) == 0
    assert calls == ["POST /v1/memory/tier"] + ["GET /v1/memory/status"] * 3
    assert "m is in tier 1 vram (1.0 MiB of weights in VRAM, context 2048)" in capsys.readouterr().out


def test_batches_lists_each_batchs_progress_and_model(capsys):
    from hypnos_cli import commands
    from hypnos_cli.client import Server

    created = int(time.time()) - 90
    running = {
        "id": "batch_1",
        "status": "in_progress",
        "endpoint": "/v1/chat/completions",
        "request_counts": {"total": 200, "completed": 57, "failed": 3},
        "hypnos_current_model": "smollm2-135m",
        "created_at": created,
    }
    done = {**running, "id": "batch_0", "status": "completed", "hypnos_current_model": None}
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json={"object": "list", "data": [running, done], "has_more": False})

    server = Server("http://h:1", None)
    server.http = httpx.Client(base_url="http://h:1", transport=httpx.MockTransport(answer))
    assert commands.do_batches(server, build_parser().parse_args(["batches", "-n", "5"])) == 0
    assert seen == ["http://h:1/v1/batches?limit=5"]
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "MODEL", "CREATED"]
    assert out[1].split()[:6] == ["batch_1", "in_progress", "/v1/chat/completions", "60/200", "3", "smollm2-135m"]
    assert out[2].split()[5] == "-" and out[1].endswith("ago")
