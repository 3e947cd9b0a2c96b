"""The model catalog: tested models with their variants, files and config blocks."""

from __future__ import annotations

import tomllib

import pytest
from django.core.management import call_command

from hypnos_site.config import DEFAULT_MODELS, ModelConfig

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
    chats = [e["id"] for e in body["data"] if "text_generation" in [e["modality"], *e["additional_modalities"]]]
    assert [e["id"] for e in tools] == chats and "gemma3-4b" in chats
    assert {"all-minilm-l6-v2", "whisper-tiny.en", "piper-joe"} <= set(entries) - {e["id"] for e in tools}
    # A folder (the Whisper model) is present when it holds the listed bytes.
    [whisper] = entries["whisper-tiny.en"]["variants"][0]["files"]
    assert whisper["present"] is True and whisper["outdated"] is False and whisper["entry"] == "model.bin"
    assert smol["gpu"] is False


async def test_every_model_of_the_default_lineup_is_listed_as_configured_and_installed(api):
    # The suite's config runs the default lineup from the files ./run.sh setup placed: each is a
    # catalog entry whose variant it runs, with the sizes the catalog lists (a folder: its files').
    entries = {e["id"]: e for e in (await api.get("/v1/models/catalog")).json()["data"]}
    for model in DEFAULT_MODELS:
        entry = entries[model.id]
        [variant] = entry["variants"]
        assert entry["lineup"] is True and entry["configured"] is True, model.id
        assert entry["configured_quant"] == variant["quant"], model.id
        assert variant["installed"] is True and variant["outdated"] is False, model.id
    documents = (await api.get("/v1/models/catalog?modality=document_conversion")).json()["data"]
    assert [e["id"] for e in documents] == ["docling"]


async def test_the_gpu_lineup_is_listed_with_its_hub_files_and_projectors(api):
    vision = (await api.get("/v1/models/catalog?modality=vision")).json()["data"]
    assert [e["id"] for e in vision] == ["gemma3-4b", "gemma3-12b", "gemma3-27b", "qwen2.5-vl-7b"]
    gemma = vision[0]
    assert (
        gemma["gpu"] is True and gemma["configured"] is False and gemma["additional_modalities"] == ["text_generation"]
    )
    [variant] = gemma["variants"]
    assert variant["installed"] is False and variant["size_bytes"] is None
    assert [(f["role"], f["repo"], f["remote"], f["local"], f["size"]) for f in variant["files"]] == [
        ("weights", "ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q4_K_M.gguf", "gemma-3-4b-it-Q4_K_M.gguf", None),
        ("aux", "ggml-org/gemma-3-4b-it-GGUF", "mmproj-model-f16.gguf", "mmproj-gemma-3-4b-it-f16.gguf", None),
    ]
    [model] = tomllib.loads(variant["config_block"])["models"]
    assert ModelConfig.model_validate(model).aux_path == "mmproj-gemma-3-4b-it-f16.gguf"
    # The image settings go into the config block, not beside it.
    images = (await api.get("/v1/models/catalog?modality=image_generation")).json()["data"]
    klein = next(e for e in images if e["id"] == "flux2-klein-4b")
    assert (
        "image" not in klein["variants"][0] and "[models.image.text_encoders]" in klein["variants"][0]["config_block"]
    )


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
    assert set(entries) == {
        "gliner-multi-v2.1",
        "gliner-small-v2.1",
        "gliner-medium-v2.1",
        "gliner-large-v2.1",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    }
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
