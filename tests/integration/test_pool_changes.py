"""Changing the model pool while the server runs (spec §6): POST /v1/models, PUT and DELETE
/v1/models/{id}, the startup checks, the drain, admin keys, and the overlay in the database."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest

from hypnos_site.config import KeyConfig
from inference.worker import Worker
from models_registry.models import ModelOverlay
from models_registry.overlay import with_overlay
from tests.conftest import PARIS_MESSAGES
from tests.integration.conftest import post_json, read_in_background, wait_until, with_server

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
URL = "/v1/chat/completions"
STORY = {
    "model": SMOL,
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    "max_tokens": 64,
    "stream": True,
}
ADMIN = "sk-admin-test"


@pytest.fixture
def pool(settings, serve) -> Worker:
    """A server whose config file holds SmolLM2 alone."""
    settings.HYPNOS = settings.HYPNOS.model_copy(update={"models": settings.HYPNOS.models[:1]})
    return serve(settings.HYPNOS)


def qwen_block(**extra: Any) -> str:
    lines = [
        "[[models]]",
        'id = "my-qwen"',
        'modality = "text_generation"',
        'engine = "ggml_llama"',
        f'weights_path = "{QWEN_FILE}"',
        "context_len = 2048",
    ]
    lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


async def put_json(api: Any, path: str, body: Any, **headers: str) -> Any:
    return await api.put(path, data=json.dumps(body), content_type="application/json", headers=headers)


async def chat(api: Any, model: str) -> Any:
    return await post_json(api, URL, {"model": model, "messages": PARIS_MESSAGES, "max_tokens": 2})


def finished_cleanly(chunks: list[bytes]) -> bool:
    body = b"".join(chunks)
    return body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body


async def test_a_model_added_by_api_is_served_at_once_and_survives_a_restart(api, pool, settings):
    added = await post_json(api, "/v1/models", {"catalog": QWEN})
    assert added.status_code == 201, added.content
    body = added.json()
    assert body["model"] == QWEN and body["action"] == "added" and body["persisted"] is True
    assert body["placement"]["primary_tier"] == "tier3_nvme_ssd"
    assert QWEN in [m["id"] for m in (await api.get("/v1/models")).json()["data"]]
    answer = await chat(api, QWEN)
    assert answer.status_code == 200 and answer.json()["hypnos_telemetry"]["previous_tier"] == "tier3_nvme_ssd"
    row = await ModelOverlay.objects.aget(model_id=QWEN)
    assert row.action == "added" and row.source == QWEN and f'weights_path = "{QWEN_FILE}"' in row.block
    # The next start: the config file still holds SmolLM2 alone, the overlay adds Qwen.
    restarted = Worker(await asyncio.to_thread(with_overlay, settings.HYPNOS))
    assert list(restarted.models) == [SMOL, QWEN]
    assert restarted.models[QWEN].config.weights_path == QWEN_FILE


async def test_a_config_block_is_added_under_its_own_id_with_its_arch_read_from_the_gguf(api, pool):
    added = await post_json(api, "/v1/models", {"config": qwen_block(aliases=["coder"])})
    assert added.status_code == 201, added.content
    runtime = pool.models["my-qwen"]
    assert runtime.config.arch.architecture == "qwen2" and runtime.config.arch.block_count == 24
    assert (await chat(api, "coder")).status_code == 200


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"config": qwen_block().replace(QWEN_FILE, "../outside.gguf")}, "is outside models_dir"),
        ({"config": qwen_block().replace(QWEN_FILE, "nothing-here.gguf")}, "does not exist in models_dir"),
        (
            {"config": qwen_block() + '[models.arch]\narchitecture = "llama"\n'},
            "[models.arch] architecture = 'llama', but the GGUF reports 'qwen2'",
        ),
        ({"config": qwen_block(slots=0)}, "models.slots"),
        ({"config": '[[models]]\nid = "x"\n[[models]]\nid = "y"\n'}, "exactly one [[models]] block"),
        ({"config": "not toml ["}, "not valid TOML"),
        ({"catalog": "qwen2.5-coder-0.5b:Q9_X"}, "has no variant 'Q9_X'"),
        ({"catalog": "no-such-model"}, "is not in the catalog"),
        ({"catalog": SMOL}, "is already taken by the model"),
        ({"catalog": QWEN, "config": qwen_block()}, "either catalog"),
    ],
)
async def test_a_model_that_fails_the_checks_is_refused_with_the_reason(api, pool, body, reason):
    refused = await post_json(api, "/v1/models", body)
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and reason in error["message"]
    assert list(pool.models) == [SMOL]
    assert not await ModelOverlay.objects.aexists()


def tiny_gguf(path: Path, architecture: str) -> None:
    """A GGUF holding nothing but its general.architecture."""
    key, value = b"general.architecture", architecture.encode()
    path.write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IQ", 8, len(value))
        + value
    )


# GGUF value types: their scalar struct formats; 8 = string, 9 = array.
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def renamed_gguf(source: Path, dest: Path, architecture: str) -> None:
    """A copy of a real GGUF that says it is of `architecture`: general.architecture rewritten,
    the old architecture's keys (`llama.block_count`, ...) renamed under the new name, where
    llama.cpp looks for them; the tensors byte for byte."""
    data = memoryview(source.read_bytes())
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string_at(at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return bytes(data[at + 8 : at + 8 + length]), at + 8 + length

    def value_end(vtype: int, at: int) -> int:
        if vtype == 8:
            return string_at(at)[1]
        if vtype == 9:
            item_type, count = struct.unpack_from("<IQ", data, at)
            at += 12
            for _ in range(count):
                at = value_end(item_type, at)
            return at
        return at + struct.calcsize("<" + GGUF_SCALARS[vtype])

    kvs, old, alignment = [], b"", 32
    for _ in range(n_kv):
        key, at = string_at(pos)
        (vtype,) = struct.unpack_from("<I", data, at)
        end = value_end(vtype, at + 4)
        if key == b"general.architecture":
            old = string_at(at + 4)[0]
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", data, at + 4)
        kvs.append((key, bytes(data[at:end])))
        pos = end
    infos_start = pos
    for _ in range(n_tensors):
        _name, at = string_at(pos)
        (n_dims,) = struct.unpack_from("<I", data, at)
        pos = at + 4 + 8 * n_dims + 4 + 8
    tensor_infos = bytes(data[infos_start:pos])
    tensor_data = data[-(-pos // alignment) * alignment :]
    out = bytearray(data[:24])
    new = architecture.encode()
    for key, value in kvs:
        if key == b"general.architecture":
            value = struct.pack("<IQ", 8, len(new)) + new
        elif key.startswith(old + b"."):
            key = new + key[len(old) :]
        out += struct.pack("<Q", len(key)) + key + value
    out += tensor_infos
    out += bytes(-len(out) % alignment)
    with dest.open("wb") as f:
        f.write(out)
        f.write(tensor_data)


def smol_file(settings) -> Path:
    return settings.HYPNOS.weights_file(settings.HYPNOS.models[0])


async def test_a_gguf_of_an_architecture_llama_cpp_does_not_know_is_refused_naming_it(api, pool, settings, tmp_path):
    renamed_gguf(smol_file(settings), tmp_path / "odd.gguf", "gpt9")
    with_server(settings, models_dir=str(tmp_path))
    refused = await post_json(api, "/v1/models", {"config": qwen_block().replace(QWEN_FILE, "odd.gguf")})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "config"
    assert "the GGUF's architecture 'gpt9' is not one this build of llama.cpp knows" in error["message"]
    assert "unknown model architecture: 'gpt9'" in error["message"]  # llama.cpp's own words
    assert list(pool.models) == [SMOL]


async def test_the_check_is_a_llama_cpp_load_not_a_list_of_names(api, pool, settings, tmp_path):
    # A known architecture whose file holds no vocabulary: llama.cpp's reason, not a name check.
    with_server(settings, models_dir=str(tmp_path))
    tiny_gguf(tmp_path / "empty.gguf", "llama")
    refused = await post_json(api, "/v1/models", {"config": qwen_block().replace(QWEN_FILE, "empty.gguf")})
    assert refused.status_code == 400, refused.content
    message = refused.json()["error"]["message"]
    assert "llama.cpp cannot load empty.gguf (error loading model vocabulary: key not found in model: " in message


async def test_a_gguf_of_a_known_but_untested_architecture_joins_the_pool_and_serves(
    api, pool, settings, tmp_path, caplog
):
    """SmolLM2 (llama) relabelled mistral3, an architecture llama.cpp builds from the same tensors
    and hyperparameters but the catalog has never tested: accepted, logged as untested, served,
    and by llama.cpp's mistral3 code the same greedy answer as SmolLM2's own."""
    weights = tmp_path / "smol-mistral3.gguf"
    renamed_gguf(smol_file(settings), weights, "mistral3")
    with_server(settings, model_paths=[str(tmp_path)])
    block = qwen_block().replace(QWEN_FILE, str(weights)).replace("my-qwen", "smol-m3")
    with caplog.at_level(logging.WARNING, logger="models_registry.pool"):
        added = await post_json(api, "/v1/models", {"config": block})
    assert added.status_code == 201, added.content
    arch = pool.models["smol-m3"].config.arch
    assert (arch.architecture, arch.context_length, arch.block_count) == ("mistral3", 8192, 30)
    assert "architecture 'mistral3' is not one of the catalog's tested_architectures" in caplog.text
    greedy = {"messages": PARIS_MESSAGES, "max_tokens": 8, "temperature": 0}
    relabelled = await post_json(api, URL, {"model": "smol-m3", **greedy})
    original = await post_json(api, URL, {"model": SMOL, **greedy})
    assert relabelled.status_code == original.status_code == 200, relabelled.content
    answer = relabelled.json()["choices"][0]["message"]["content"]
    assert answer and answer == original.json()["choices"][0]["message"]["content"]


async def test_a_replacement_under_load_fails_no_request_and_unloads_the_old_model(api, pool):
    old = pool.models[SMOL]
    stream = await post_json(api, URL, STORY)
    reading, chunks = read_in_background(stream)
    replacing = asyncio.create_task(put_json(api, f"/v1/models/{SMOL}", {"catalog": QWEN}))
    assert await wait_until(lambda: old.change_done is not None, timeout=30)
    # Arrives while the old model drains: it waits, then the new model serves it.
    waiting = asyncio.create_task(chat(api, SMOL))
    await reading
    replaced = await replacing
    assert replaced.status_code == 200, replaced.content
    assert replaced.json()["action"] == "replaced" and replaced.json()["model"] == SMOL
    answer = await waiting
    assert answer.status_code == 200 and answer.json()["model"] == SMOL
    assert finished_cleanly(chunks)
    new = pool.models[SMOL]
    assert new is not old and new.config.weights_path == QWEN_FILE and new.loads == 1
    assert old.engine is None  # the old model was unloaded
    assert (await ModelOverlay.objects.aget(model_id=SMOL)).action == "replaced"


async def test_a_change_past_drain_secs_is_refused_and_the_old_model_stays(api, pool):
    old = pool.models[SMOL]
    stream = await post_json(api, URL, STORY)
    reading, chunks = read_in_background(stream)
    refused = await put_json(api, f"/v1/models/{SMOL}", {"catalog": QWEN, "drain_secs": 0.05})
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "model_busy"
    await reading
    assert finished_cleanly(chunks)
    assert pool.models[SMOL] is old and old.change_done is None
    assert (await chat(api, SMOL)).status_code == 200
    assert not await ModelOverlay.objects.aexists()


async def test_a_delete_during_a_stream_lets_it_finish_then_answers_404(api, pool):
    old = pool.models[SMOL]
    stream = await post_json(api, URL, STORY)
    reading, chunks = read_in_background(stream)
    removing = asyncio.create_task(api.delete(f"/v1/models/{SMOL}?drain_secs=30"))
    assert await wait_until(lambda: old.change_done is not None, timeout=30)
    waiting = asyncio.create_task(chat(api, "gpt-4o-mini"))  # by alias
    await reading
    assert finished_cleanly(chunks)
    removed = await removing
    assert removed.status_code == 200 and removed.json() == {"model": SMOL, "action": "removed", "persisted": True}
    late = await waiting
    assert late.status_code == 404 and late.json()["error"]["type"] == "model_not_found"
    assert (await chat(api, SMOL)).status_code == 404
    assert (await api.get("/v1/models")).json()["data"] == []
    assert old.engine is None and SMOL not in pool.tiers.entries
    # SmolLM2 is in the config file, so the overlay remembers its removal.
    assert (await ModelOverlay.objects.aget(model_id=SMOL)).action == "removed"


async def test_removing_an_added_model_leaves_no_overlay_behind(api, pool):
    assert (await post_json(api, "/v1/models", {"catalog": QWEN})).status_code == 201
    assert (await api.delete(f"/v1/models/{QWEN}")).status_code == 200
    assert not await ModelOverlay.objects.aexists()
    assert (await api.delete(f"/v1/models/{QWEN}")).status_code == 404


async def test_only_admin_keys_change_the_pool(api, pool, settings):
    with_server(settings, api_keys=[ADMIN], keys=[KeyConfig(key="sk-user", label="user")])
    user = {"authorization": "Bearer sk-user"}
    refused = await post_json(api, "/v1/models", {"catalog": QWEN}, **user)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_denied"
    assert (await api.delete(f"/v1/models/{SMOL}", headers=user)).status_code == 403
    assert (await api.get("/v1/models", headers=user)).status_code == 200
    added = await post_json(api, "/v1/models", {"catalog": QWEN}, authorization=f"Bearer {ADMIN}")
    assert added.status_code == 201


async def test_options_layer_defaults_config_and_saved_and_apply_at_once(api, pool, settings):
    url = f"/v1/models/{SMOL}/options"
    layers = (await api.get(url)).json()
    assert layers["defaults"]["context_len"] == 4096 and layers["config"]["context_len"] == 2048
    assert layers["saved"] == {} and layers["effective"]["context_len"] == 2048
    assert layers["effective"]["temperature"] == 0.8

    dry = (await post_json(api, url, {"max_tokens": 3, "dry_run": True})).json()
    assert dry["dry_run"] is True and dry["effective"]["max_tokens"] == 3
    assert (await api.get(url)).json()["saved"] == {}

    saved = (await post_json(api, url, {"max_tokens": 3, "temperature": 0.0})).json()
    assert saved["action"] == "updated" and saved["persisted"] is True
    assert saved["saved"] == {"max_tokens": 3, "temperature": 0.0}
    story = {"model": SMOL, "messages": STORY["messages"]}
    first, second = [(await post_json(api, URL, story)).json() for _ in range(2)]
    assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    # A request's own value wins over the saved default.
    assert (await post_json(api, URL, {**story, "max_tokens": 5})).json()["usage"]["completion_tokens"] == 5
    # The other text routes take the same defaults.
    response = (await post_json(api, "/v1/responses", {"model": SMOL, "input": "Write a long story."})).json()
    assert response["usage"]["output_tokens"] == 3
    completion = (await post_json(api, "/v1/completions", {"model": SMOL, "prompt": "Once upon a time"})).json()
    assert completion["usage"]["completion_tokens"] == 3

    merged = (await post_json(api, url, {"temperature": None, "context_len": 3072})).json()
    assert (
        merged["saved"] == {"max_tokens": 3, "context_len": 3072, "ctx_size": 3072} and merged["action"] == "reloaded"
    )
    assert pool.models[SMOL].config.context_len == 3072
    restarted = Worker(await asyncio.to_thread(with_overlay, settings.HYPNOS))
    assert restarted.models[SMOL].config.context_len == 3072
    assert restarted.models[SMOL].config.sampling.max_tokens == 3

    cleared = (await api.delete(url)).json()
    assert cleared["saved"] == {} and cleared["effective"]["context_len"] == 2048
    assert pool.models[SMOL].config.context_len == 2048


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"nope": 1}, "unknown option 'nope'"),
        ({"slots": 0}, "slots"),
        ({"temperature": 9}, "temperature"),
    ],
)
async def test_options_that_do_not_validate_are_refused(api, pool, body, reason):
    refused = await post_json(api, f"/v1/models/{SMOL}/options", body)
    assert refused.status_code == 400 and reason in refused.json()["error"]["message"]
    assert (await api.get(f"/v1/models/{SMOL}/options")).json()["saved"] == {}


def smol_block(weights_path: str) -> str:
    return "\n".join(
        [
            "[[models]]",
            'id = "my-smol"',
            'modality = "text_generation"',
            'engine = "ggml_llama"',
            f"weights_path = {json.dumps(weights_path)}",
            "context_len = 2048",
        ]
    )


async def test_the_users_own_files_are_served_from_the_folders_the_operator_allows(api, pool, settings, tmp_path):
    """An absolute weights_path, or a symlink in models_dir, is served when it resolves inside
    models_dir or server.model_paths, and refused when it resolves anywhere else."""
    import shutil

    mine, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    mine.mkdir()
    elsewhere.mkdir()
    source = settings.HYPNOS.weights_file(settings.HYPNOS.models[0])
    shutil.copy(source, mine / "smol.gguf")
    shutil.copy(source, elsewhere / "smol.gguf")
    link = settings.HYPNOS.models_dir / "hypnos-test-link.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(elsewhere / "smol.gguf")
    try:
        refused = await post_json(api, "/v1/models", {"config": smol_block(str(mine / "smol.gguf"))})
        assert refused.status_code == 400 and "is outside models_dir" in refused.json()["error"]["message"]
        linked = await post_json(api, "/v1/models", {"config": smol_block(link.name)})
        assert linked.status_code == 400 and str(elsewhere) not in settings.HYPNOS.server.model_paths

        with_server(settings, model_paths=[str(mine)])
        added = await post_json(api, "/v1/models", {"config": smol_block(str(mine / "smol.gguf"))})
        assert added.status_code == 201, added.content
        assert (await chat(api, "my-smol")).status_code == 200
        assert (await api.delete("/v1/models/my-smol")).status_code == 200

        with_server(settings, model_paths=[str(mine), str(elsewhere)])
        added = await post_json(api, "/v1/models", {"config": smol_block(link.name)})
        assert added.status_code == 201, added.content
        assert (await chat(api, "my-smol")).status_code == 200
        assert (await api.delete("/v1/models/my-smol")).status_code == 200
    finally:
        link.unlink(missing_ok=True)
