"""A pool change made through one web process of a distributed server: seen at once by the other
web process, served by the worker, and still there after every process restarts."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from hypnos_site.config import BASE_DIR, load_config
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Proc, base_env, free_port, migrate, start, stop_all, wait_ready, write_config

pytestmark = pytest.mark.e2e

QWEN = "qwen2.5-coder-0.5b"


def start_servers(env: dict[str, str], ports: list[int], directory, round_: int) -> list[Proc]:  # type: ignore[no-untyped-def]
    procs = [start(f"runinference-{round_}", ["manage.py", "runinference"], env, directory)]
    for port in ports:
        procs.append(
            start(f"daphne-{port}-{round_}", ["-m", "hypnos_site.serve"], {**env, "HYPNOS_PORT": str(port)}, directory)
        )
    for port in ports:
        wait_ready(f"http://127.0.0.1:{port}", *procs)
    return procs


def ask(port: int, model: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=model, messages=PARIS_MESSAGES, max_tokens=8, temperature=0)
    return answer.choices[0].message.content or ""


def test_a_model_added_through_one_web_process_is_served_everywhere_and_survives_a_restart(
    tmp_path, redis_url, postgres_url
):
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    ports = [free_port(), free_port()]
    env = base_env(
        write_config(tmp_path, entity_model=False),  # the test adds Qwen2.5-Coder-0.5B itself
        tmp_path,
        HYPNOS_DEPLOYMENT="distributed",
        HYPNOS_DATABASE_URL=postgres_url,
        HYPNOS_REDIS_URL=redis_url,
        HYPNOS_CHANNEL_PREFIX="hypnos-pool-" + uuid.uuid4().hex[:8],
        HYPNOS_MODELS_DIR=str(suite.models_dir),
    )
    migrate(env)
    procs = start_servers(env, ports, tmp_path, 1)
    try:
        # Both web processes have listed the pool before the change.
        for port in ports:
            assert QWEN not in httpx.get(f"http://127.0.0.1:{port}/v1/models").text
        added = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/models", json={"catalog": QWEN}, timeout=60)
        assert added.status_code == 201, added.text
        assert added.json()["persisted"] is True
        assert ask(ports[1], QWEN)  # the other web process routes it at once
    finally:
        stop_all(procs)
    procs = start_servers(env, ports, tmp_path, 2)
    try:
        listed = [m["id"] for m in httpx.get(f"http://127.0.0.1:{ports[1]}/v1/models").json()["data"]]
        assert QWEN in listed
        assert ask(ports[0], QWEN)
        removed = httpx.delete(f"http://127.0.0.1:{ports[1]}/v1/models/{QWEN}", timeout=60)
        assert removed.status_code == 200 and removed.json()["action"] == "removed"
        gone = httpx.post(
            f"http://127.0.0.1:{ports[0]}/v1/chat/completions", json={"model": QWEN, "messages": PARIS_MESSAGES}
        )
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "model_not_found"
    finally:
        stop_all(procs)
