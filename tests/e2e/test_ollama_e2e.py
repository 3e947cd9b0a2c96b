"""The official `ollama` Python client, unchanged, against live servers (issue 17): list, ps,
show, chat (whole and streamed), generate, tools, embed, errors, and a pull with progress from a
hub on 127.0.0.1 (then delete) on a server with keys, the client sending its `headers=`."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import ollama
import pytest

from hypnos_site.config import BASE_DIR, load_config
from tests.conftest import PARIS_MESSAGES
from tests.e2e.conftest import Server, embedded_server
from tests.integration.test_downloads import HubHandler, HubServer, HubState, entry, hub_file, variant

pytestmark = pytest.mark.e2e
SMOL, EMBED = "smollm2-135m", "all-minilm-l6-v2"
# Tool calls and entities on the smaller Qwen (the 1.5B's template and grammar, a third of the time).
TOOLS = ENTITIES = "qwen2.5-coder-0.5b"
CODER_15 = "qwen2.5-coder-1.5b"
ADMIN, PLAIN = "sk-ollama-e2e-admin", "sk-ollama-e2e-plain"
PULLED = "smol-pulled"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def client(server: Server, key: str | None = None) -> ollama.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return ollama.Client(host=server.base_url, timeout=300, headers=headers)


def test_the_client_lists_shows_and_sees_what_runs(server):
    ollama_client = client(server)
    listed = {m.model: m for m in ollama_client.list().models}
    assert {f"{SMOL}:latest", f"{ENTITIES}:latest", f"{CODER_15}:latest", f"{EMBED}:latest"} == set(listed)
    smol = listed[f"{SMOL}:latest"]
    assert smol.size > 50_000_000 and smol.details.family == "llama" and smol.details.quantization_level == "Q4_1"
    # Just used, so in tier 1 whatever the tests before it loaded (each server's tier 1 is 3 GiB).
    ollama_client.generate(model=SMOL, prompt="Hi", options={"num_predict": 1})
    running = {m.model: m for m in ollama_client.ps().models}
    assert running[f"{SMOL}:latest"].size > smol.size  # the weights and the context
    assert running[f"{SMOL}:latest"].expires_at > datetime.now(UTC)
    assert running[f"{SMOL}:latest"].context_length >= 4096
    shown = ollama_client.show(SMOL)
    assert shown.capabilities == ["completion"] and shown.modelinfo["general.architecture"] == "llama"
    assert shown.details.parameter_size == "135M"
    assert ollama_client.show(TOOLS).capabilities == ["completion", "tools"]


def test_the_client_chats_and_streams_the_same_answer(server):
    ollama_client = client(server)
    whole = ollama_client.chat(model=SMOL, messages=PARIS_MESSAGES, options={"temperature": 0})
    assert "Paris" in whole.message.content and whole.done and whole.done_reason == "stop"
    assert whole.eval_count > 3 and whole.eval_duration > 0 and whole.total_duration > whole.eval_duration
    chunks = list(
        ollama_client.chat(model=f"{SMOL}:latest", messages=PARIS_MESSAGES, options={"temperature": 0}, stream=True)
    )
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].done and chunks[-1].eval_count == whole.eval_count
    assert not any(c.done for c in chunks[:-1])


def test_the_client_generates_within_num_predict(server):
    answer = client(server).generate(model=SMOL, prompt="Tell me a story.", options={"num_predict": 5, "seed": 1})
    assert answer.done_reason == "length" and answer.eval_count == 5 and answer.response


def test_the_client_embeds_as_v1_embeddings_does(server):
    texts = ["A man is eating food.", "The stock market crashed today."]
    embedded = client(server).embed(model=EMBED, input=texts)
    v1 = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": EMBED, "input": texts}, timeout=60).json()
    assert [list(v) for v in embedded.embeddings] == [d["embedding"] for d in v1["data"]]
    assert len(embedded.embeddings[0]) == 384


def test_an_unknown_model_raises_the_clients_response_error_streamed_or_not(server):
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as caught:
            if stream:
                list(client(server).chat(model="no-such-model", messages=PARIS_MESSAGES, stream=True))
            else:
                client(server).chat(model="no-such-model", messages=PARIS_MESSAGES)
        assert caught.value.status_code == 404 and caught.value.error == "model 'no-such-model' not found"


def test_the_client_gets_tool_calls_with_object_arguments(embedded):
    asked = [{"role": "user", "content": "What's the weather in Paris?"}]
    answer = client(embedded).chat(model=TOOLS, messages=asked, tools=[WEATHER], options={"temperature": 0})
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}


# -- a server with keys and a catalog on a local hub -------------------------------------------


@pytest.fixture(scope="module")
def hub_and_catalog(tmp_path_factory) -> Iterator[tuple[Server, HubState, bytes]]:
    """An embedded server with an admin and a plain key whose catalog lists `smol-pulled`, the
    suite's SmolLM2 served by a hub on 127.0.0.1 (HF_ENDPOINT)."""
    suite = load_config({"HYPNOS_CONFIG": str(BASE_DIR / "tests" / "hypnos.test.toml")})
    data = suite.weights_file(next(m for m in suite.models if m.id == SMOL)).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    state = HubState(files={"/acme/smol-GGUF/resolve/main/smol-pulled.gguf": data})
    hub = HubServer(("127.0.0.1", 0), type("Handler", (HubHandler,), {"state": state}))
    threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    directory = tmp_path_factory.mktemp("ollama")
    (directory / "models.catalog.toml").write_text(
        'catalog_version = 1\ntested_architectures = ["llama"]\n'
        + entry(
            PULLED,
            variant("Q4_1", hub_file("acme/smol-GGUF", "smol-pulled.gguf", len(data), f'sha256 = "{sha}"'), True),
        )
    )
    keys = f'[server]\napi_keys = ["{ADMIN}"]\nkeys = [{{ key = "{PLAIN}", label = "plain" }}]\n'
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_address[1]}")
            patch.delenv("HF_TOKEN", raising=False)
            with embedded_server("ollama", directory, lambda text: text.replace("[server]\n", keys, 1)) as server:
                yield server, state, data
    finally:
        hub.shutdown()
        hub.server_close()


def test_the_client_pulls_with_progress_chats_and_deletes(hub_and_catalog):
    server, _, data = hub_and_catalog
    admin = client(server, ADMIN)
    progress = list(admin.pull(PULLED, stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    downloading = [p for p in progress if p.digest]
    assert downloading and downloading[-1].completed == downloading[-1].total == len(data)
    assert f"{PULLED}:latest" in {m.model for m in admin.list().models}
    answer = admin.chat(model=PULLED, messages=PARIS_MESSAGES, options={"temperature": 0})
    assert "Paris" in answer.message.content
    assert admin.delete(PULLED).status == "success"
    assert f"{PULLED}:latest" not in {m.model for m in admin.list().models}


def test_keys_reach_the_ollama_routes_through_the_clients_headers(hub_and_catalog):
    server, _, _ = hub_and_catalog
    with pytest.raises(ollama.ResponseError) as caught:
        client(server).list()
    assert caught.value.status_code == 401
    plain = client(server, PLAIN)
    assert f"{SMOL}:latest" in {m.model for m in plain.list().models}
    assert plain.generate(model=SMOL, prompt="Hi", options={"num_predict": 2}).eval_count == 2
    with pytest.raises(ollama.ResponseError) as refused:
        plain.pull(PULLED)
    assert refused.value.status_code == 403 and "admin key" in refused.value.error
