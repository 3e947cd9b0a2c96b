"""The model catalog: tested models with their variants, files and config blocks."""

from __future__ import annotations

import tomllib

import pytest
from django.core.management import call_command

from hypnos_site.config import ModelConfig

pytestmark = pytest.mark.django_db(transaction=True)


async def test_the_catalog_lists_the_tested_models_and_what_is_installed(api):
    body = (await api.get("/v1/models/catalog")).json()
    assert body["catalog_version"] == 1 and "qwen2" in body["tested_architectures"]
    entries = {e["id"]: e for e in body["data"]}
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(entries)
    smol = entries["smollm2-135m"]
    assert smol["configured"] is True and smol["enabled"] is True and smol["configured_quant"] == "Q4_1"
    [variant] = smol["variants"]
    assert variant["installed"] is True and variant["outdated"] is False
    assert variant["files"][0]["present"] is True and variant["size_bytes"] == 98362432
    tools = (await api.get("/v1/models/catalog?modality=text_generation")).json()["data"]
    assert [e["id"] for e in tools] == [e["id"] for e in body["data"] if e["modality"] == "text_generation"]
    assert {"all-minilm-l6-v2", "whisper-tiny.en", "piper-joe"} <= set(entries) - {e["id"] for e in tools}
    # A folder (the Whisper model) is present when it holds the listed bytes.
    [whisper] = entries["whisper-tiny.en"]["variants"][0]["files"]
    assert whisper["present"] is True and whisper["outdated"] is False and whisper["entry"] == "model.bin"
    assert (await api.get("/v1/models/catalog?modality=vision")).json()["data"] == []


async def test_a_config_block_is_a_valid_model_block(api):
    entries = {e["id"]: e for e in (await api.get("/v1/models/catalog")).json()["data"]}
    block = entries["qwen2.5-coder-1.5b"]["variants"][0]["config_block"]
    [model] = tomllib.loads(block)["models"]
    parsed = ModelConfig.model_validate(model)
    assert parsed.package_parts == 22 and parsed.tool_router is True
    assert parsed.additional_modalities == ["entity_extraction"]


async def test_the_gliner_entries_list_no_sizes_and_run_on_the_gliner_engine(api):
    body = (await api.get("/v1/models/catalog?modality=entity_extraction")).json()
    entries = {e["id"]: e for e in body["data"]}
    # The chat models that extract entities are listed too (additional_modalities).
    assert set(entries) == {"gliner-multi-v2.1", "gliner-small-v2.1", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert entries["qwen2.5-coder-1.5b"]["additional_modalities"] == ["entity_extraction"]
    int8, fp32 = entries["gliner-multi-v2.1"]["variants"]
    assert (int8["quant"], int8["default"], fp32["quant"]) == ("int8", True, "fp32")
    assert int8["size_bytes"] is None and int8["installed"] is False and int8["outdated"] is False
    assert [(f["role"], f["repo"], f["remote"], f["size"]) for f in int8["files"]] == [
        ("weights", "onnx-community/gliner_multi-v2.1", "onnx/model_int8.onnx", None),
        ("tokenizer", "onnx-community/gliner_multi-v2.1", "tokenizer.json", None),
        ("data", "onnx-community/gliner_multi-v2.1", "gliner_config.json", None),
    ]
    assert fp32["files"][0]["remote"] == "onnx/model.onnx"
    [model] = tomllib.loads(entries["gliner-small-v2.1"]["variants"][0]["config_block"])["models"]
    parsed = ModelConfig.model_validate(model)
    assert (parsed.modality, parsed.engine, parsed.weights_path) == (
        "entity_extraction",
        "gliner",
        "gliner_small-v2.1/onnx/model_int8.onnx",
    )


def test_the_catalog_block_command_prints_the_same_block(capsys):
    call_command("catalogblock", "qwen2.5-coder-0.5b:Q4_K_M")
    printed = capsys.readouterr().out
    assert 'weights_path = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"' in printed
    assert ModelConfig.model_validate(tomllib.loads(printed)["models"][0]).id == "qwen2.5-coder-0.5b"
