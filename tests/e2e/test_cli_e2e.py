"""The `hypnos` command (issue 17), the console script `./run.sh setup` installs, run as a
subprocess against one live embedded server with an admin key and a catalog whose `smol-pulled`
a hub on 127.0.0.1 serves: list, ps, load / unload, run (one prompt, and a chat fed through
stdin), keys, logs (and -f), status, pull with its progress bar, and the message when no server
answers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hypnos_site.config import BASE_DIR, load_config
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server, embedded_server, free_port
from tests.integration.test_downloads import HubHandler, HubServer, HubState, entry, hub_file, variant

pytestmark = pytest.mark.e2e
SMOL, EMBED, PULLED = "smollm2-135m", "all-minilm-l6-v2", "smol-pulled"
ADMIN = "sk-cli-e2e-admin"
HYPNOS = Path(sys.executable).with_name("hypnos")
SYSTEM, QUESTION = PARIS_MESSAGES[0]["content"], PARIS_MESSAGES[1]["content"]
# The command's environment: what it is told comes from its options, not from the developer's.
ENV = {k: v for k, v in os.environ.items() if k not in ("HYPNOS_URL", "HYPNOS_API_KEY")}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """The embedded server, SmolLM2 in tier 1, an admin key in server.api_keys, and a catalog
    listing `smol-pulled` (the suite's SmolLM2 file) on a hub on 127.0.0.1 (HF_ENDPOINT)."""
    assert HYPNOS.exists(), f"{HYPNOS} is missing: ./run.sh setup installs the hypnos command"
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    data = suite.weights_file(next(m for m in suite.models if m.id == SMOL)).read_bytes()
    state = HubState(files={"/acme/smol-GGUF/resolve/main/smol-pulled.gguf": data})
    hub = HubServer(("127.0.0.1", 0), type("Handler", (HubHandler,), {"state": state}))
    threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    directory = tmp_path_factory.mktemp("cli")
    sha = f'sha256 = "{hashlib.sha256(data).hexdigest()}"'
    (directory / "models.catalog.toml").write_text(
        'catalog_version = 1\ntested_architectures = ["llama"]\n'
        + entry(PULLED, variant("Q4_1", hub_file("acme/smol-GGUF", "smol-pulled.gguf", len(data), sha), True))
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_address[1]}")
            patch.delenv("HF_TOKEN", raising=False)
            keys = f'[server]\napi_keys = ["{ADMIN}"]\n'
            with embedded_server("cli", directory, lambda text: text.replace("[server]\n", keys, 1)) as live:
                yield live
    finally:
        hub.shutdown()
        hub.server_close()


def hypnos(
    server: Server | str, *args: str, key: str | None = ADMIN, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    url = server if isinstance(server, str) else server.base_url
    command = [str(HYPNOS), "--url", url, *(["--key", key] if key else []), *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, env=ENV, timeout=300)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (done.args, done.returncode, done.stdout, done.stderr)
    return done.stdout


def row(output: str, model: str) -> list[str]:
    """The cells of the table row whose first cell is `model` (cells are two spaces apart)."""
    [line] = [line for line in output.splitlines() if line.split("  ")[0] == model]
    return [cell.strip() for cell in line.split("  ") if cell.strip()]


def test_list_shows_each_models_modality_tier_context_and_capabilities(server):
    listed = ok(hypnos(server, "list"))
    assert listed.splitlines()[0].split() == ["ID", "MODALITY", "TIER", "CONTEXT", "CAPABILITIES"]
    assert row(listed, SMOL)[:4] == [SMOL, "text_generation", "1 vram", "4096"]
    assert "chat" in row(listed, SMOL)[4].split(",")
    embed = row(listed, EMBED)
    assert embed[1] == "embeddings" and embed[3:] == ["512", "embeddings"]
    served = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert json.loads(ok(hypnos(server, "list", "--json"))) == served


def test_load_and_unload_move_a_model_and_ps_shows_where_it_is(server):
    before = ok(hypnos(server, "ps"))
    assert "tier 1" in before and row(before, SMOL)[1] == "1 vram"
    assert EMBED not in before and row(ok(hypnos(server, "ps", "--all")), EMBED)[1] == "3 disk"
    assert "is in tier 1 vram" in ok(hypnos(server, "load", EMBED))
    loaded = row(ok(hypnos(server, "ps")), EMBED)
    assert loaded[1] == "1 vram" and loaded[2].endswith("MiB") and loaded[6] == "0"  # no lease held
    assert "is in tier 2 ram" in ok(hypnos(server, "unload", EMBED))
    assert row(ok(hypnos(server, "ps")), EMBED)[1] == "2 ram"
    models = {m["id"]: m for m in json.loads(ok(hypnos(server, "ps", "--json")))["models"]}
    assert models[EMBED]["current_tier"] == "tier2_pinned_ram"


def test_run_answers_one_prompt_and_exits(server):
    done = hypnos(server, "run", SMOL, "--system", SYSTEM, "--temperature", "0", QUESTION)
    assert "Paris" in ok(done)


def chat_records(server: Server) -> list[dict]:
    """The request log's chat records, oldest first, as `hypnos logs --json` prints them."""
    printed = ok(hypnos(server, "logs", "--json", "-n", "200", "--route", "chat/completions"))
    return [json.loads(line) for line in printed.splitlines()]


def test_run_chats_over_stdin_keeping_the_history_and_logs_show_both_turns(server):
    before = len(chat_records(server))
    turns = f"{QUESTION}\nAnd what is the capital of Italy?\n/bye\nnever sent\n"
    done = hypnos(server, "run", SMOL, "--system", SYSTEM, "--temperature", "0", "--max-tokens", "30", stdin=turns)
    assert "Paris" in ok(done) and len(done.stdout.strip().splitlines()) >= 2
    records = chat_records(server)
    assert len(records) == before + 2 and all(r["stream"] and r["model"] == SMOL for r in records[-2:])
    first, second = records[-2:]
    # The second turn carried the first question and answer before its own.
    assert second["tokens_in"] > first["tokens_in"] + first["tokens_out"]


def test_logs_follow_prints_a_new_record_once_as_it_lands(server):
    command = [str(HYPNOS), "--url", server.base_url, "--key", ADMIN, "logs", "-f", "--json", "--interval", "0.2"]
    follower = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in follower.stdout or ():
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        time.sleep(1)
        chat = {"model": SMOL, "messages": PARIS_MESSAGES, "max_tokens": 2}
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=60,
        )
        wanted, seen = answer.headers["x-request-id"], []
        deadline = time.monotonic() + 60
        while seen.count(wanted) == 0 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                seen.append(json.loads(lines.get(timeout=1))["id"])
        # A few more polls: the record is not printed again.
        time.sleep(1)
        while not lines.empty():
            seen.append(json.loads(lines.get())["id"])
        assert seen.count(wanted) == 1
    finally:
        follower.terminate()
        follower.wait(10)


def test_keys_are_created_listed_and_revoked_and_a_revoked_key_is_refused(server):
    made = hypnos(server, "keys", "create", "ci-bot", "--requests-per-minute", "100")
    key = ok(made).strip()
    assert key.startswith("hyp_") and "store it now" in made.stderr
    assert SMOL in ok(hypnos(server, "list", key=key))
    listed = ok(hypnos(server, "keys", "list"))
    assert row(listed, "ci-bot")[1:5] == [key[:12], "no", "yes", "database"]
    assert row(listed, "ci-bot")[5] == "100 req/min"
    assert "revoked the key 'ci-bot'" in ok(hypnos(server, "keys", "revoke", "ci-bot"))
    refused = hypnos(server, "list", key=key)
    assert refused.returncode == 1 and "Invalid API key" in refused.stderr and "--key" in refused.stderr
    assert row(ok(hypnos(server, "keys", "list")), "ci-bot")[3] == "revoked"
    missing = hypnos(server, "keys", "list", key=None)
    assert missing.returncode == 1 and "Missing API key" in missing.stderr


def test_pull_draws_its_progress_and_the_model_joins_the_pool(server):
    done = hypnos(server, "pull", PULLED)
    assert ok(done).splitlines()[0] == "pulling manifest" and done.stdout.splitlines()[-1] == "success"
    assert "100%" in done.stderr and f"hypnos run {PULLED}" in done.stderr
    assert row(ok(hypnos(server, "list")), PULLED)[1] == "text_generation"
    unknown = hypnos(server, "pull", "no-such-model")
    assert unknown.returncode == 1 and "not found" in unknown.stderr and "/v1/models/catalog" in unknown.stderr


def test_run_sh_passes_a_verb_to_the_same_command(server):
    """`./run.sh ps` as the README shows it, the URL and key from the environment."""
    venv = Path(sys.executable).parent.parent
    env = ENV | {"HYPNOS_URL": server.base_url, "HYPNOS_API_KEY": ADMIN, "HYPNOS_VENV": str(venv)}
    done = subprocess.run([str(BASE_DIR / "run.sh"), "ps"], capture_output=True, text=True, env=env, timeout=300)
    assert row(ok(done), SMOL)[1] == "1 vram"


def test_status_reports_the_server_ready_with_its_tiers(server):
    status = ok(hypnos(server, "status"))
    assert "ready    yes" in status and "tier 1" in status and "in tier 1" in status


def test_with_no_server_every_verb_says_so_and_exits_1():
    url = f"http://127.0.0.1:{free_port()}"
    verbs = (["list"], ["ps"], ["pull", PULLED], ["load", SMOL], ["unload", SMOL], ["run", SMOL, "hi"])
    for verb in (*verbs, ["keys", "list"], ["keys", "create", "k"], ["logs"], ["status"]):
        done = hypnos(url, *verb)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr == f"hypnos: no Hypnos server answers at {url} — start one with ./run.sh\n"
